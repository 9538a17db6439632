# GPU run (issue #29): the host's part of a decode step after the decode graphs' staging became incremental (a row's
# block table is copied whole only when its sequence changed, shrank or was freed; otherwise only its new entries).
# 1. the CUDA graph-replay test and the speculative-decoding tests on the kernels (trimmed tables); 2. qwen3-8b
# (random weights, --load-format dummy): a decode step of 256 sequences at 2K context, bf16 against FP8 KV, GPU time
# and with the host's part (kv_dtype_ab.sh); 3. prompt 512 at batch 64 (bf16), a batch-64 step profiled.
# `bash bench/device/host_round.sh`; carries .whl and .gpu. About 6 minutes. JSON and logs under $OUT.
source bench/device/setup.sh
ENGINE_TEST_DEVICE=cuda timeout ${TESTS_S:-90} python3 -m pytest -q -p no:cacheprovider tests/engine/test_kernels.py \
  tests/engine/test_spec_decode_kernels.py -k "graph_replay or spec or draft or verify" 2>&1 \
  | tee "$OUT/cuda-tests-host.txt" | tail -4 || true
ENGINE_S=${ENGINE_S:-100} source bench/device/kv_dtype_ab.sh  # writes the qwen3-8b shape too
ENGINE_S=${ENGINE_S:-100} engine_bench qwen3-8b-b64 /tmp/shapes/qwen3-8b --prompt-len 512 --new-tokens 32 \
  --batch-sizes 64 --profile --profile-batch 64
# At most 8 files come back from the machine: the logs go back as one archive.
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)

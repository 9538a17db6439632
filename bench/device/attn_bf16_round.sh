# GPU run (issue #29): bf16 decode attention on the 1-warp, 32-key programs with the lazy rescale, splits filling one
# wave of 8 programs an SM (triton_ops.DECODE_TILES, engine.kernels.DECODE_PROGRAMS_PER_SM), measured in the engine.
# 1. the CUDA attention tests and the graph replay test; 2. qwen3-8b (random weights, --load-format dummy): a decode
# step of 256 sequences at 2K context, bf16 against FP8 KV (kv_dtype_ab.sh); 3. prompt 512 at batch 1 and 64 (bf16),
# a batch-64 step profiled (host and GPU time); 4. batch 64 again on the 4-warp, 64-key bf16 tile of round six
# (ENGINE_DECODE_TILES), the same call's A/B. `bash bench/device/attn_bf16_round.sh`; carries .whl and .gpu. About
# 5 minutes. JSON and logs under $OUT.
source bench/device/setup.sh
ENGINE_TEST_DEVICE=cuda timeout ${TESTS_S:-100} python3 -m pytest -q -p no:cacheprovider tests/engine/test_kernels.py \
  -k "attention or fp8_cache or unmasked or override or sized_from or strides or graph_replay" 2>&1 \
  | tee "$OUT/cuda-tests-bf16.txt" | tail -4 || true
ENGINE_S=${ENGINE_S:-100} source bench/device/kv_dtype_ab.sh  # writes the qwen3-8b shape too
ENGINE_S=${ENGINE_S:-100} engine_bench qwen3-8b-b1-b64 /tmp/shapes/qwen3-8b --prompt-len 512 --new-tokens 32 \
  --batch-sizes 1 64 --profile --profile-batch 64
ENGINE_DECODE_TILES='{"bf16": {"block_n": 64, "warps": 4, "stages": 2}}' ENGINE_S=${ENGINE_S:-100} engine_bench \
  qwen3-8b-b64-tile64 /tmp/shapes/qwen3-8b --prompt-len 512 --new-tokens 32 --batch-sizes 64 --profile \
  --profile-batch 64
# At most 8 files come back from the machine: the logs go back as one archive.
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)

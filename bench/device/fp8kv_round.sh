# GPU run (issue #29, FP8 KV): the head-major KV cache. The CUDA attention / KV tests, then decode attention alone
# (bench/device/fp8_tune.py: batch 256 at 2K context and batch 16 at 8K, bf16 and FP8 caches, head-major against the
# slot-major layout it replaced, same kernel, same values), then qwen3-8b (random weights, --load-format dummy) at
# batch 256 with 2,048-token prompts, bf16 against FP8 KV in the engine. About 7 minutes on an H200.
# `bash bench/device/fp8kv_round.sh`; carries .whl and .gpu (setup.sh). JSON and logs under $OUT.
source bench/device/setup.sh
ENGINE_TEST_DEVICE=cuda timeout ${TESTS_S:-130} python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_kernels.py tests/engine/test_engine_attention.py tests/engine/test_sparse.py 2>&1 \
  | tee "$OUT/cuda-tests-kv.txt" | tail -4 || true
timeout ${TUNE_S:-150} python3 bench/device/fp8_tune.py --only attention --seconds ${PART_S:-125} \
  --json "$OUT/attention-layouts.json" 2>&1 | grep -v -i warn | tee "$OUT/attention-layouts.log" \
  | grep -v "^attention [0-9]" || true
ENGINE_S=${ENGINE_S:-75} MEASURE=throughput source bench/device/kv_dtype_ab.sh

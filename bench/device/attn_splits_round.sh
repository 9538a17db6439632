# GPU run (issue #29): decode attention with each split sized from its sequence's own context, many small programs
# (engine.kernels.decode_splits, DECODE_PROGRAMS_PER_SM) and the measured decode tiles (triton_ops.decode_tile).
# 1. the CUDA kernel tests; 2. decode attention alone by split count (fp8_tune.py --only splits: batch 256 / 2K,
# 64 / 544, 16 / 8K, 1 / 4K; bf16 and FP8 caches; a few tiles each); 3. qwen3-8b (random weights, --load-format
# dummy) in the engine: batch 256 with 2,048-token prompts, bf16 against FP8 KV (kv_dtype_ab.sh), then prompt 512 at
# batch 1 and 64 (bf16). `bash bench/device/attn_splits_round.sh`; carries .whl and .gpu. About 9 minutes. JSON and
# logs under $OUT.
source bench/device/setup.sh
ENGINE_TEST_DEVICE=cuda timeout ${TESTS_S:-100} python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_kernels.py -k "attention or fp8 or kernels_generates or cache or sized_from" 2>&1 \
  | tee "$OUT/cuda-tests-splits.txt" | tail -4 || true
timeout ${TUNE_S:-150} python3 bench/device/fp8_tune.py --only splits --seconds ${PART_S:-135} \
  --json "$OUT/attention-splits.json" 2>&1 | grep -v -i warn | tee "$OUT/attention-splits.log" || true
ENGINE_S=${ENGINE_S:-80} MEASURE=throughput source bench/device/kv_dtype_ab.sh  # writes the qwen3-8b shape too
ENGINE_S=${ENGINE_S:-80} engine_bench qwen3-8b-b1-b64 /tmp/shapes/qwen3-8b --prompt-len 512 --new-tokens 32 \
  --batch-sizes 1 64

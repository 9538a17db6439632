# GPU run (issue #29): the decode attention loop with fewer instructions a key: tiles every query sees whole run
# without masks, and the running maximum moves only when a row's grew by more than 2^8 (a lazy rescale), scores in
# base 2. 1. the CUDA kernel tests; 2. decode attention alone by loop (fp8_tune.py --only loops: the loop before,
# each change alone and both; batch 256 / 2K, 64 / 544, 16 / 8K, 1 / 4K; bf16 and FP8 caches); 3. qwen3-8b (random
# weights, --load-format dummy) in the engine: a decode step of 256 sequences at 2K context, bf16 against FP8 KV
# (kv_dtype_ab.sh), then prompt 512 at batch 1 and 64 (bf16). `bash bench/device/attn_loops_round.sh`; carries
# .whl and .gpu. About 9 minutes. JSON and logs under $OUT.
source bench/device/setup.sh
ENGINE_TEST_DEVICE=cuda timeout ${TESTS_S:-110} python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_kernels.py -k "attention or fp8 or kernels_generates or cache or sized_from or unmasked" 2>&1 \
  | tee "$OUT/cuda-tests-loops.txt" | tail -4 || true
timeout ${TUNE_S:-130} python3 bench/device/fp8_tune.py --only loops --seconds ${PART_S:-115} \
  --json "$OUT/attention-loops.json" 2>&1 | grep -v -i warn | tee "$OUT/attention-loops.log" | grep best || true
ENGINE_S=${ENGINE_S:-100} source bench/device/kv_dtype_ab.sh  # writes the qwen3-8b shape too
ENGINE_S=${ENGINE_S:-100} engine_bench qwen3-8b-b1-b64 /tmp/shapes/qwen3-8b --prompt-len 512 --new-tokens 32 \
  --batch-sizes 1 64

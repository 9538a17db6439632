# GPU run (issue #29): decode attention by split count, now that a split is sized from each sequence's own context
# (fp8_tune.py --only splits: batch 256 / 2K, 64 / 544, 16 / 8K, 1 / 4K; bf16 and FP8 caches; a few tiles each),
# after the CUDA kernel tests. `bash bench/device/attn_splits_round.sh`; carries .whl and .gpu. About 4 minutes.
source bench/device/setup.sh
ENGINE_TEST_DEVICE=cuda timeout ${TESTS_S:-120} python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_kernels.py -k "attention or fp8 or kernels_generates or cache or sized_from or family" 2>&1 \
  | tee "$OUT/cuda-tests-splits.txt" | tail -4 || true
timeout ${TUNE_S:-220} python3 bench/device/fp8_tune.py --only splits --seconds ${PART_S:-200} \
  --json "$OUT/attention-splits.json" 2>&1 | grep -v -i warn | tee "$OUT/attention-splits.log" || true

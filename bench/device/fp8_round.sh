# GPU run (issue #29, FP8): the FP8 decode kernels timed with weights and caches streamed from HBM
# (bench/device/fp8_tune.py), then the CUDA kernel tests. `bash bench/device/fp8_round.sh`; carries .whl and .gpu.
source bench/device/setup.sh
ENGINE_TEST_DEVICE=cuda timeout ${TESTS_S:-120} python3 -m pytest -q -p no:cacheprovider -x \
  tests/engine/test_kernels.py 2>&1 | tee "$OUT/cuda-kernel-tests.txt" | tail -4 || true
timeout ${TUNE_S:-420} python3 bench/device/fp8_tune.py --seconds ${PART_S:-190} --json "$OUT/fp8-tune.json" 2>&1 \
  | grep -v -i warn | tee "$OUT/fp8-tune.log" | grep -v "^attention [0-9]" || true

# GPU run (issue #29, #30): the CUDA tests of --async-scheduling (a step scheduled ahead is launched without any
# host-device synchronization, under CUDA's sync debug mode), the kernels' graph and sampler tests, and the P/D tests
# with the engines' steps running ahead (ipc on the GPU, reservations, chunk-by-chunk transfer).
# `bash bench/device/async_tests_round.sh`; carries .whl, .gpu and .deb. About 5 minutes.
source bench/device/setup.sh
source bench/device/mooncake_cuda.sh || true
ENGINE_TEST_DEVICE=cuda ENGINE_TEST_DTYPE=bfloat16 timeout ${TESTS_S:-420} python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_async_scheduling.py tests/engine/test_disagg_reserve.py tests/test_pd_overlap.py \
  tests/engine/test_kv_ipc.py tests/engine/test_kernels.py -k "not sampler_features" 2>&1 \
  | tee "$OUT/cuda-tests-async-final.txt" | tail -15 || true

# GPU run (issue #29, #30): the CUDA tests of --async-scheduling (a step scheduled ahead is launched without any
# host-device synchronization, under CUDA's sync debug mode), and the P/D tests
# with the engines' steps running ahead (ipc on the GPU, reservations, chunk-by-chunk transfer).
# `bash bench/device/async_tests_round.sh`; carries .whl, .gpu and .deb. About 4 minutes.
source bench/device/setup.sh
source bench/device/mooncake_cuda.sh || true
# ONLY=1: the async-scheduling tests alone (about 80 s).
ENGINE_TEST_DEVICE=cuda ENGINE_TEST_DTYPE=bfloat16 timeout ${TESTS_S:-240} python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_async_scheduling.py $([ -z "${ONLY:-}" ] && echo tests/engine/test_disagg_reserve.py \
  tests/test_pd_overlap.py tests/engine/test_kv_ipc.py) 2>&1 \
  | tee "$OUT/cuda-tests-async-final.txt" | tail -15 || true

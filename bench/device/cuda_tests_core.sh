# GPU run: the engine's parameter, kernel and core tests in one process (a lingering server engine of one
# module once invalidated another module's graph capture). `bash bench/device/cuda_tests_core.sh`.
source bench/device/setup.sh >/dev/null
ENGINE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_openai_params.py \
  tests/engine/test_kernels.py tests/engine/test_engine_core.py 2>&1 | tee "$OUT/cuda-tests-core.txt" | tail -4

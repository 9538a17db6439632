source bench/device/setup.sh >/dev/null
ENGINE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_openai_params.py tests/engine/test_kernels.py tests/engine/test_engine_core.py 2>&1 | tail -4

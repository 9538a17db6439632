# GPU run (issue #29, speed): the decode kernels tuned inside CUDA graphs, weights and caches streamed from HBM
# (bench/device/fp8_tune.py; it replaced kernel_tune.py, whose replays of one weight were served from L2), the
# CUDA kernel and family tests, and (issue #30) the KV transfer bench through the CUDA Mooncake bundle.
# `bash bench/device/decode_kernels.sh`; carries .whl, .gpu and .deb (setup.sh, mooncake_cuda.sh).
source bench/device/setup.sh
timeout ${TUNE_S:-330} python3 bench/device/fp8_tune.py --seconds 150 --json "$OUT/kernel-tune.json" 2>&1 | grep -v -i warn || true
ENGINE_TEST_DEVICE=cuda timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider -x \
  tests/engine/test_kernels.py tests/engine/test_model_families.py 2>&1 | tee "$OUT/cuda-tests.txt" | tail -8 || true
if [ -n "${TRANSFER_S:-}" ]; then
  source bench/device/mooncake_cuda.sh || true
  timeout "$TRANSFER_S" python3 -m bench.engine.kv_transfer --device cuda --dtype bf16 --backend direct \
    --tokens 1024,4096,8192 --layouts contiguous,scattered --repeats 3 --json "$OUT/pd-transfer-direct.json" 2>&1 \
    | tail -20 || true
fi

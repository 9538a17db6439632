# GPU run (issue #29, batch 64): is cuBLAS the right kernel for a batch-64 decode step's matmuls? The skinny-matmul
# kernel on 64-token tiles against cuBLAS at 64 tokens on qwen3-8b's layers (fp8_tune.py --only gemv64), after the
# CUDA tests of the engine's kernels and graphs (test_kernels.py but the sampler's, which needs xgrammar).
# `bash bench/device/gemv64_round.sh`; carries .whl and .gpu. About 5 minutes. JSON and log under $OUT.
source bench/device/setup.sh
ENGINE_TEST_DEVICE=cuda timeout ${TESTS_S:-90} python3 -m pytest -q -p no:cacheprovider tests/engine/test_kernels.py \
  -k "not sampler_features" 2>&1 | tee "$OUT/cuda-tests-kernels.txt" | tail -4 || true
timeout ${TUNE_S:-200} python3 bench/device/fp8_tune.py --only gemv64 --seconds ${PART_S:-185} \
  --json "$OUT/gemv64.json" 2>&1 | grep -v -i warn | tee "$OUT/gemv64.log" | grep gemv64 || true

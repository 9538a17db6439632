# GPU run: the engine's CUDA tests, then a quick decode benchmark with a profile of one step.
#   bash bench/device/engine_smoke.sh        (on the GPU machine; writes under $OUT)
source bench/device/setup.sh
ENGINE_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_kernels.py \
  tests/engine/test_engine_core.py tests/engine/test_sparse.py tests/engine/test_engine_attention.py \
  2>&1 | tee "$OUT/cuda-tests-kernels.txt" | tail -25 || true
timeout 200 python3 -m bench.engine.throughput --model "$MODEL" --device cuda --batch-sizes 1 64 --prompt-len 512 \
  --new-tokens 128 --runs 2 --no-reference --profile --json "$OUT/smoke.json" 2>&1 | tee "$OUT/smoke.txt" | tail -12 || true

# GPU run: the engine's CUDA tests and the engine benchmark against transformers eager, with the prefix-cache row
# and a profile of one batch-1 decode step. `bash bench/device/engine_bench_main.sh`; writes under $OUT.
source bench/device/setup.sh
ENGINE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine \
  -k "not smollm2 and not reference and not kv_transfer and not disagg" 2>&1 | tee "$OUT/cuda-tests.txt" | tail -6 || true
timeout 240 python3 -m bench.engine.throughput --model "$MODEL" --device cuda --prompt-len 512 --new-tokens 128 \
  --batch-sizes 1 16 64 256 --runs 3 --prefix-row 3000 --profile --json "$OUT/engine-bench-cuda.json" 2>&1 \
  | grep -v -i warn | tee "$OUT/engine-bench-cuda.txt" | tail -45 || true

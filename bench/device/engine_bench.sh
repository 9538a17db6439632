# GPU run: the engine benchmark against transformers (eager, then compiled), the prefix-cache row and a
# profile of one batch-1 decode step. `bash bench/device/engine_bench.sh` on the GPU machine; writes under $OUT.
source bench/device/setup.sh
COMMON=(--model "$MODEL" --device cuda --prompt-len 512 --new-tokens 128)
timeout 240 python3 -m engine.bench "${COMMON[@]}" --batch-sizes 1 16 64 256 --runs 3 --prefix-row 3000 \
  --profile --json "$OUT/engine-bench-cuda.json" 2>&1 | grep -v Warning | tee "$OUT/engine-bench-cuda.txt" | tail -45 || true
timeout 300 python3 -m engine.bench "${COMMON[@]}" --batch-sizes 1 64 --runs 2 --compiled \
  --json "$OUT/engine-bench-cuda-compiled.json" 2>&1 | grep -v Warning | tee "$OUT/engine-bench-cuda-compiled.txt" | tail -25 || true

# GPU run: the engine against transformers with a static cache under torch.compile (each mode tried in turn).
# `bash bench/device/engine_compiled.sh` on the GPU machine; writes under $OUT.
source bench/device/setup.sh
timeout 300 python3 -m bench.engine.throughput --model "$MODEL" --device cuda --prompt-len 512 --new-tokens 128 \
  --batch-sizes 1 64 --runs 2 --compiled --json "$OUT/engine-bench-cuda-compiled.json" 2>&1 \
  | grep -v -i warn | tee "$OUT/engine-bench-cuda-compiled.txt" | tail -25 || true

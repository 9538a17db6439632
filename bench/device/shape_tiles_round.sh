# GPU run (issue #29, batch-1 targets): one token's matmul on the tiles measured best for qwen3-8b's shapes
# (engine.kernels.token_gemv.MEASURED_TILES; SHAPE_TILES 1 e4m3 weights', 2 16-bit ones', 3 both, 0 none: the rules
# alone), the decode step's norms on the CUDA kernel. 1. the CUDA tests of the one-token kernels and the norm; 2.
# qwen3-8b with FP8 weights and in bf16 at batch 1 (prompt 512, 128 new tokens), each setting in its own process,
# alternating, ROUNDS times; 3. qwen3-30b-a3b on the defaults. `bash bench/device/shape_tiles_round.sh`; carries
# .whl, .gpu.
source bench/device/setup.sh
cuda_tests "token or norm" tests/engine/test_kernels.py
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b >/dev/null
python3 bench/device/shape_config.py qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b >/dev/null
run() {  # NAME MODEL SHAPE_TILES ROUND ARGS...
  local name=$1 model=$2 tiles=$3 round=$4
  shift 4
  ab_bench "$name-tiles$tiles-$round" "$model" engine.kernels.token_gemv.SHAPE_TILES="$tiles" -- --batch-sizes 1 \
    --new-tokens 128 "$@" | grep -E "^ +1 \|" | sed "s/^/$name tiles$tiles $round /" || true
}
for round in $(seq "${ROUNDS:-2}"); do
  for tiles in 0 3; do
    run qwen3-8b-fp8 /tmp/shapes/qwen3-8b "$tiles" "$round" --quantization fp8
    run qwen3-8b /tmp/shapes/qwen3-8b "$tiles" "$round"
  done
done
run qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b 3 1
(cd "$OUT" && tar rf runs.tar ./*.log ./*.json && rm -f ./*.log ./*.json) 2>/dev/null || true

# GPU run (issue #29, qwen3-30b-a3b at 50% of its batch-1 roofline): one token's residual add and RMSNorm in the last
# block of the layer before them (token_gemv's NORM epilogue: the o projection, the down projection or the experts'
# down projection) against their own Triton launch (ENGINE_TOKEN_NORM=triton). 1. the CUDA tests of the epilogue,
# the one-token kernels and the model families that take it; 2. bench/device/token_norm_bench.py (the epilogue
# alone, in chains of layers); 3. each shape of SHAPES (qwen3-30b-a3b) at batch 1 (prompt 512, 128 new tokens), the
# runs of RUNS (cuda-1 triton-1 cuda-2 triton-2: ENGINE_TOKEN_NORM and a round), each in its own process; FP8=1:
# FP8 weights. `bash bench/device/token_norm_round.sh`; carries .whl, .gpu.
source bench/device/setup.sh
cuda_tests "residual_add or one_token or cuda_matmul or wide_enough" tests/engine/test_kernels.py \
  tests/engine/test_moe.py tests/engine/test_model_families.py
python3 bench/device/token_norm_bench.py --json "$OUT/token-norm-bench.json" 2>&1 | grep -v -i warn || true
for shape in ${SHAPES:-qwen3-30b-a3b}; do
  python3 bench/device/shape_config.py "$shape" "/tmp/shapes/$shape" >/dev/null
  for run in ${RUNS:-cuda-1 triton-1 cuda-2 triton-2}; do
    ENGINE_TOKEN_NORM=${run%-*} ENGINE_S=${ENGINE_S:-80} ab_bench "$shape-norm-$run" "/tmp/shapes/$shape" -- \
      --batch-sizes 1 --new-tokens 128 ${FP8:+--quantization fp8} | sed "s/^/$shape $run /" || true
  done
done
(cd "$OUT" && tar czf runs.tgz ./*.log && rm -f ./*.log)

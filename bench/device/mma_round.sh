# GPU run (issue #29), twenty-second round: one token's e4m3 linear layers on the tensor cores (token_mma.cu,
# token_gemv.MMA) against the CUDA cores' kernel (token_gemv.cu). `PART=1 bash bench/device/mma_round.sh`: the CUDA
# tests of both kernels and the FP8 paths, then qwen3-8b's projections alone and as a 36-layer chain
# (bench/device/token_gemv_bench.py, FP8 only), then the engine at batch 1 once each: FP8 weights on either kernel,
# and bf16. `PART=2`: the engine only: the same three alternating, twice each; the tensor cores for the layers
# without SwiGLU only (MMA=1); the tensor cores' launches letting the next kernel in after their loop (EARLY=0); then
# llama31-8b (bf16) at batch 1 and 64 (64 new tokens), whose figures were from before the one-token kernels.
# Carries .whl, .gpu.
source bench/device/setup.sh
B1=(--batch-sizes 1 --new-tokens 128)
K=engine.kernels.token_gemv
if [ "${PART:-1}" = 1 ]; then
  cuda_tests "tensor_core or one_tokens_cuda_matmul or scaled_mm or fp8" tests/engine/test_kernels.py \
    tests/engine/test_fp8.py tests/engine/test_model_families.py
  timeout 240 python3 bench/device/token_gemv_bench.py --dtypes fp8 --json "$OUT/token-gemv.json" 2>&1 \
    | grep -v -i warn | tee "$OUT/token-gemv.log" | grep -E "^(qkv|o|gate_up|down) fp8 (mma|triton)|^chain" || true
  shape_row fp8-mma qwen3-8b $K.MMA=3 -- "${B1[@]}" --quantization fp8
  shape_row fp8-cores qwen3-8b $K.MMA=0 -- "${B1[@]}" --quantization fp8
  shape_row bf16 qwen3-8b -- "${B1[@]}"
else
  for round in 1 2; do
    shape_row "fp8-cores-$round" qwen3-8b $K.MMA=0 -- "${B1[@]}" --quantization fp8
    shape_row "fp8-mma-$round" qwen3-8b $K.MMA=3 -- "${B1[@]}" --quantization fp8
    shape_row "bf16-$round" qwen3-8b -- "${B1[@]}"
  done
  shape_row fp8-mma-linear qwen3-8b $K.MMA=1 -- "${B1[@]}" --quantization fp8
  shape_row fp8-mma-late qwen3-8b $K.MMA=3 $K.EARLY=0 -- "${B1[@]}" --quantization fp8
  shape_row llama31-8b-b1 llama31-8b -- "${B1[@]}"
  ENGINE_S=100 shape_row llama31-8b-b64 llama31-8b -- --batch-sizes 64 --new-tokens 64
fi
(cd "$OUT" && tar rf runs.tar ./*.log ./*.json && rm -f ./*.log ./*.json) 2>/dev/null || true

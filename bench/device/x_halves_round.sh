# GPU run (issue #29, FP8 weights at batch 1): e4m3 launches of one token's matmul with x staged in halves (each
# chunk's two 16-byte halves in separate arrays, no bank conflicts in the loop: engine.kernels.token_gemv.X_HALVES=1)
# or as it is (0, the default until measured). 1. the CUDA test of the kernel against the float32 product (both
# layouts) and the norm's chain test (against torch too); 2. qwen3-8b with FP8 weights at batch 1 (prompt 512, 128 new tokens) and qwen3-8b in bf16 on the default
# (the ratio's denominator), each setting in its own process, alternating, ROUNDS times (2).
# `bash bench/device/x_halves_round.sh`; carries .whl, .gpu.
source bench/device/setup.sh
cuda_tests "cuda_matmul_matches or cuda_norm_matches" tests/engine/test_kernels.py
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b >/dev/null
for round in $(seq "${ROUNDS:-2}"); do
  for halves in 0 1; do
    ab_bench "qwen3-8b-fp8-halves$halves-$round" /tmp/shapes/qwen3-8b engine.kernels.token_gemv.X_HALVES=$halves -- \
      --batch-sizes 1 --new-tokens 128 --quantization fp8 | grep -E "^ +1 \|" \
      | sed "s/^/qwen3-8b-fp8 halves=$halves $round /" || true
  done
  ab_bench "qwen3-8b-$round" /tmp/shapes/qwen3-8b engine.kernels.token_gemv.X_HALVES=0 -- --batch-sizes 1 \
    --new-tokens 128 | grep -E "^ +1 \|" | sed "s/^/qwen3-8b $round /" || true
done
(cd "$OUT" && tar rf runs.tar ./*.log ./*.json && rm -f ./*.log ./*.json) 2>/dev/null || true

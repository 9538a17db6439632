# GPU run (issue #29, batch 1): the RMS norm folded into the linear layer after it (token_gemv.cu's NORM:
# engine.kernels.token_gemv.FUSE_NORM=1) or launched apart (0); and e4m3 launches with x staged in halves
# (X_HALVES=1) or as it is (0): qwen3-8b (bf16, FP8 weights) and qwen3-30b-a3b at batch 1 (prompt 512, 128 new
# tokens), each setting in its own process, ROUNDS times (2); then one profiled run of qwen3-8b with the norms folded
# in (each kernel's share of the step). Run bench/device/norm_gemv_tests.sh first.
# `bash bench/device/norm_gemv_round.sh`; carries .whl, .gpu.
source bench/device/setup.sh
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b >/dev/null
python3 bench/device/shape_config.py qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b >/dev/null
B1=(--batch-sizes 1 --new-tokens 128)
for round in $(seq "${ROUNDS:-2}"); do
  for fuse in 0 1; do
    ab_bench "qwen3-8b-fuse$fuse-$round" /tmp/shapes/qwen3-8b engine.kernels.token_gemv.FUSE_NORM=$fuse -- "${B1[@]}" \
      | grep -E "^ +1 \|" | sed "s/^/qwen3-8b fuse=$fuse $round /" || true
    ab_bench "qwen3-8b-fp8-fuse$fuse-$round" /tmp/shapes/qwen3-8b engine.kernels.token_gemv.FUSE_NORM=$fuse -- \
      "${B1[@]}" --quantization fp8 | grep -E "^ +1 \|" | sed "s/^/qwen3-8b-fp8 fuse=$fuse $round /" || true
  done
  ab_bench "qwen3-8b-fp8-halves-$round" /tmp/shapes/qwen3-8b engine.kernels.token_gemv.X_HALVES=1 -- "${B1[@]}" \
    --quantization fp8 | grep -E "^ +1 \|" | sed "s/^/qwen3-8b-fp8 fuse=1 halves=1 $round /" || true
  for fuse in 0 1; do
    ab_bench "qwen3-30b-a3b-fuse$fuse-$round" /tmp/shapes/qwen3-30b-a3b engine.kernels.token_gemv.FUSE_NORM=$fuse -- \
      "${B1[@]}" | grep -E "^ +1 \|" | sed "s/^/qwen3-30b-a3b fuse=$fuse $round /" || true
  done
done
ENGINE_S=120 ab_bench "qwen3-8b-fuse1-profile" /tmp/shapes/qwen3-8b engine.kernels.token_gemv.FUSE_NORM=1 -- \
  --batch-sizes 1 --new-tokens 64 --profile >/dev/null || true
sed -n '/critical path/,/^[^ ]/p' "$OUT/qwen3-8b-fuse1-profile.log" | head -30 || true
(cd "$OUT" && tar rf runs.tar ./*.log ./*.json && rm -f ./*.log ./*.json) 2>/dev/null || true

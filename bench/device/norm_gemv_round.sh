# GPU run (issue #29, batch 1): RMS norms folded into the launch of the layer after them (token_gemv.cu's NORM;
# engine.kernels.token_gemv.FUSE_NORM, a sum of 1: before the QKV projection, 2: before gate/up with SwiGLU, 4: before
# a MoE router) against their own launches (0); and e4m3 launches with x staged in halves (X_HALVES=1). qwen3-8b (bf16:
# 0, 1, 3; FP8 weights: 0, 3, and 3 in halves) and qwen3-30b-a3b (0, 1, 5) at batch 1 (prompt 512, 128 new tokens),
# each setting in its own process, ROUNDS times (1); then, with PROFILE=1, one profiled run of qwen3-8b with FUSE_NORM=3
# (each kernel's share of the step). Run bench/device/norm_gemv_tests.sh first; two calls of this make two rounds.
# `bash bench/device/norm_gemv_round.sh`; carries .whl, .gpu.
source bench/device/setup.sh
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b >/dev/null
python3 bench/device/shape_config.py qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b >/dev/null
B1=(--batch-sizes 1 --new-tokens 128)
K=engine.kernels.token_gemv
for round in $(seq "${ROUNDS:-1}"); do
  for fuse in 0 1 3; do
    ab_bench "qwen3-8b-fuse$fuse-$round" /tmp/shapes/qwen3-8b $K.FUSE_NORM=$fuse -- "${B1[@]}" \
      | grep -E "^ +1 \|" | sed "s/^/qwen3-8b fuse=$fuse $round /" || true
  done
  for fuse in 0 3; do
    ab_bench "qwen3-8b-fp8-fuse$fuse-$round" /tmp/shapes/qwen3-8b $K.FUSE_NORM=$fuse -- "${B1[@]}" --quantization fp8 \
      | grep -E "^ +1 \|" | sed "s/^/qwen3-8b-fp8 fuse=$fuse $round /" || true
  done
  ab_bench "qwen3-8b-fp8-halves-$round" /tmp/shapes/qwen3-8b $K.FUSE_NORM=3 $K.X_HALVES=1 -- "${B1[@]}" \
    --quantization fp8 | grep -E "^ +1 \|" | sed "s/^/qwen3-8b-fp8 fuse=3 halves=1 $round /" || true
  for fuse in 0 1 5; do
    ab_bench "qwen3-30b-a3b-fuse$fuse-$round" /tmp/shapes/qwen3-30b-a3b $K.FUSE_NORM=$fuse -- "${B1[@]}" \
      | grep -E "^ +1 \|" | sed "s/^/qwen3-30b-a3b fuse=$fuse $round /" || true
  done
done
if [ -n "${PROFILE:-}" ]; then
  ENGINE_S=120 ab_bench "qwen3-8b-fuse3-profile" /tmp/shapes/qwen3-8b $K.FUSE_NORM=3 -- --batch-sizes 1 \
    --new-tokens 64 --profile >/dev/null || true
  sed -n '/critical path/,/^[^ ]/p' "$OUT/qwen3-8b-fuse3-profile.log" | head -30 || true
fi
(cd "$OUT" && tar rf runs.tar ./*.log ./*.json && rm -f ./*.log ./*.json) 2>/dev/null || true

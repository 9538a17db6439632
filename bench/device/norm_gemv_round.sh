# GPU run (issue #29, batch 1), the twenty-first round's candidates against the defaults, each setting in its own
# process: RMS norms folded into the launch of the layer after them (token_gemv.cu's NORM;
# engine.kernels.token_gemv.FUSE_NORM, a sum of 1: before the QKV projection, 2: before gate/up with SwiGLU, 4: before
# a MoE router; 0: their own launches); a decode step's rope and K/V store in its attention launch
# (engine.kernels.triton_ops.ROPE_IN_ATTENTION=1); the attention letting the next kernel in first thing
# (ATTENTION_TRIGGER=1, PDL_EARLY; 2, after its loop, is the default), and with it a second run of every weight row
# staged in shared memory before the wait (token_gemv.STAGE_RUNS=1). e4m3 launches with x staged in halves
# (token_gemv.X_HALVES=1) lost 0.4% and were taken out after the round too. The round also read the attention's first
# tile before the PDL wait (PREFETCH_KV=1, with the rope); that lost 2% and was taken out after the round
# (docs/engine.md, twenty-first round), so its row is gone and the rows with the rope run without it.
# PART=1: qwen3-8b bf16 at FUSE_NORM 0, with the attention early, and staged too; at FUSE_NORM 1, 3, then 3 with the
# rope, with the attention early too, and staged too; SmolLM2's shape with either trigger.
# PART=2: FP8 weights at 0, with the attention early, and staged too; all but those two, and all of them;
# qwen3-30b-a3b at 0, 5, and with all of them.
# Unset: both (more than one call's 600 s). Batch 1, prompt 512, 128 new tokens, ROUNDS times (1). With PROFILE=1,
# one profiled run of qwen3-8b with all of them (each kernel's share of the step). Run
# bench/device/norm_gemv_tests.sh first.
# `PART=1 bash bench/device/norm_gemv_round.sh`, then `PART=2 ...`; carries .whl, .gpu.
source bench/device/setup.sh
B1=(--batch-sizes 1 --new-tokens 128)
K=engine.kernels.token_gemv
ROPE=engine.kernels.triton_ops.ROPE_IN_ATTENTION
EARLY=engine.kernels.triton_ops.ATTENTION_TRIGGER=1
STAGE=$K.STAGE_RUNS=1
for round in $(seq "${ROUNDS:-1}"); do
  if [ "${PART:-1}" = 1 ]; then
    shape_row "qwen3-8b-fuse0-$round" qwen3-8b $K.FUSE_NORM=0 -- "${B1[@]}"
    shape_row "qwen3-8b-early-$round" qwen3-8b $K.FUSE_NORM=0 $EARLY -- "${B1[@]}"
    shape_row "qwen3-8b-early-stage-$round" qwen3-8b $K.FUSE_NORM=0 $EARLY $STAGE -- "${B1[@]}"
    for fuse in 1 3; do shape_row "qwen3-8b-fuse$fuse-$round" qwen3-8b $K.FUSE_NORM=$fuse -- "${B1[@]}"; done
    shape_row "qwen3-8b-fuse3-rope-$round" qwen3-8b $K.FUSE_NORM=3 $ROPE=1 -- "${B1[@]}"
    shape_row "qwen3-8b-all-early-$round" qwen3-8b $K.FUSE_NORM=3 $ROPE=1 $EARLY -- "${B1[@]}"
    shape_row "qwen3-8b-all-early-stage-$round" qwen3-8b $K.FUSE_NORM=3 $ROPE=1 $EARLY $STAGE -- "${B1[@]}"
    for early in 2 1; do  # the embedded model, whose attention lost 9% early in the tenth round
      ab_bench "smollm2-trigger$early-$round" "$MODEL" engine.kernels.triton_ops.ATTENTION_TRIGGER=$early -- \
        "${B1[@]}" | grep -E "^ +1 \|" | sed "s/^/smollm2-trigger$early $round /" || true
    done
  fi
  if [ "${PART:-2}" = 2 ]; then
    F8=(--quantization fp8)
    shape_row "qwen3-8b-fp8-fuse0-$round" qwen3-8b $K.FUSE_NORM=0 -- "${B1[@]}" "${F8[@]}"
    shape_row "qwen3-8b-fp8-early-$round" qwen3-8b $K.FUSE_NORM=0 $EARLY -- "${B1[@]}" "${F8[@]}"
    shape_row "qwen3-8b-fp8-early-stage-$round" qwen3-8b $K.FUSE_NORM=0 $EARLY $STAGE -- "${B1[@]}" "${F8[@]}"
    shape_row "qwen3-8b-fp8-all-$round" qwen3-8b $K.FUSE_NORM=3 $ROPE=1 -- "${B1[@]}" "${F8[@]}"
    shape_row "qwen3-8b-fp8-all-early-stage-$round" qwen3-8b $K.FUSE_NORM=3 $ROPE=1 $EARLY $STAGE -- "${B1[@]}" \
      "${F8[@]}"
    for fuse in 0 5; do shape_row "qwen3-30b-a3b-fuse$fuse-$round" qwen3-30b-a3b $K.FUSE_NORM=$fuse -- "${B1[@]}"; done
    shape_row "qwen3-30b-a3b-all-early-stage-$round" qwen3-30b-a3b $K.FUSE_NORM=5 $ROPE=1 $EARLY $STAGE -- "${B1[@]}"
  fi
done
if [ -n "${PROFILE:-}" ]; then
  [ -d /tmp/shapes/qwen3-8b ] || python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b >/dev/null
  ENGINE_S=120 ab_bench "qwen3-8b-all-profile" /tmp/shapes/qwen3-8b $K.FUSE_NORM=3 $ROPE=1 $EARLY $STAGE -- \
    --batch-sizes 1 --new-tokens 64 --profile >/dev/null || true
  sed -n '/critical path/,/^[^ ]/p' "$OUT/qwen3-8b-all-profile.log" | head -30 || true
fi
(cd "$OUT" && tar rf runs.tar ./*.log ./*.json && rm -f ./*.log ./*.json) 2>/dev/null || true

# GPU run (issue #29, batch 1), after norm_gemv_round.sh's PART=1 (docs/engine.md, twenty-first round; that script
# was taken out with the norm folded into the QKV and gate/up launches, and is at commit cade3aa): the rope in the
# attention launch alone and with the attention early and a run staged (the norm folded and the first tile read
# early lost there); staging with and without the attention early; the same on FP8 weights (and with x in halves,
# token_gemv.X_HALVES, which lost and was taken out after the round: its rows are gone); on qwen3-30b-a3b the
# router's norm folded alone (token_gemv.ROUTER_NORM=1; the rows of the defaults set 0, the default then) and the
# rope with the attention early and staging.
# Batch 1, prompt 512, 128 new tokens, each setting in its own process, ROUNDS times (1).
# `bash bench/device/rope_stage_round.sh`; carries .whl, .gpu.
source bench/device/setup.sh
B1=(--batch-sizes 1 --new-tokens 128)
K=engine.kernels.token_gemv
T=engine.kernels.triton_ops
ROPE=$T.ROPE_IN_ATTENTION=1
ES=($T.ATTENTION_TRIGGER=1 $K.STAGE_RUNS=1)  # the attention early, a run staged
F8=(--quantization fp8)
for round in $(seq "${ROUNDS:-1}"); do
  shape_row "qwen3-8b-$round" qwen3-8b $K.ROUTER_NORM=0 -- "${B1[@]}"
  shape_row "qwen3-8b-rope-$round" qwen3-8b $ROPE -- "${B1[@]}"
  shape_row "qwen3-8b-stage-$round" qwen3-8b $K.STAGE_RUNS=1 -- "${B1[@]}"
  shape_row "qwen3-8b-early-stage-$round" qwen3-8b "${ES[@]}" -- "${B1[@]}"
  shape_row "qwen3-8b-rope-early-stage-$round" qwen3-8b $ROPE "${ES[@]}" -- "${B1[@]}"
  shape_row "qwen3-8b-fp8-$round" qwen3-8b $K.ROUTER_NORM=0 -- "${B1[@]}" "${F8[@]}"
  shape_row "qwen3-8b-fp8-rope-$round" qwen3-8b $ROPE -- "${B1[@]}" "${F8[@]}"
  shape_row "qwen3-8b-fp8-early-stage-$round" qwen3-8b "${ES[@]}" -- "${B1[@]}" "${F8[@]}"
  shape_row "qwen3-8b-fp8-rope-early-stage-$round" qwen3-8b $ROPE "${ES[@]}" -- "${B1[@]}" "${F8[@]}"
  shape_row "qwen3-30b-a3b-$round" qwen3-30b-a3b $K.ROUTER_NORM=0 -- "${B1[@]}"
  shape_row "qwen3-30b-a3b-router-norm-$round" qwen3-30b-a3b $K.ROUTER_NORM=1 -- "${B1[@]}"
  shape_row "qwen3-30b-a3b-rope-$round" qwen3-30b-a3b $ROPE -- "${B1[@]}"
  shape_row "qwen3-30b-a3b-rope-early-stage-$round" qwen3-30b-a3b $ROPE "${ES[@]}" -- "${B1[@]}"
  shape_row "qwen3-8b-again-$round" qwen3-8b $K.ROUTER_NORM=0 -- "${B1[@]}"
  shape_row "qwen3-8b-rope-again-$round" qwen3-8b $ROPE -- "${B1[@]}"
done
(cd "$OUT" && tar rf runs.tar ./*.log ./*.json && rm -f ./*.log ./*.json) 2>/dev/null || true

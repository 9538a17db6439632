# GPU run (issue #29, batch 1), after rope_stage_round.sh (docs/engine.md, twenty-first round): which of the attention
# early (ATTENTION_TRIGGER=1) and a run staged (token_gemv.STAGE_RUNS=1) pays with the rope in the attention launch
# (ROPE_IN_ATTENTION=1), on qwen3-8b bf16 and FP8 weights and qwen3-30b-a3b, and on qwen3-30b-a3b with the router's
# norm folded too (token_gemv.ROUTER_NORM=1; the first row sets 0, the default then). Batch 1, prompt 512, 128 new
# tokens, each setting in its own process. `bash bench/device/rope_split_round.sh`; carries .whl, .gpu.
source bench/device/setup.sh
B1=(--batch-sizes 1 --new-tokens 128)
K=engine.kernels.token_gemv
T=engine.kernels.triton_ops
ROPE=$T.ROPE_IN_ATTENTION=1
EARLY=$T.ATTENTION_TRIGGER=1
STAGE=$K.STAGE_RUNS=1
F8=(--quantization fp8)
shape_row "qwen3-8b" qwen3-8b $K.ROUTER_NORM=0 -- "${B1[@]}"
shape_row "qwen3-8b-rope-early" qwen3-8b $ROPE $EARLY -- "${B1[@]}"
shape_row "qwen3-8b-rope-stage" qwen3-8b $ROPE $STAGE -- "${B1[@]}"
shape_row "qwen3-8b-rope-early-stage" qwen3-8b $ROPE $EARLY $STAGE -- "${B1[@]}"
shape_row "qwen3-8b-fp8-rope" qwen3-8b $ROPE -- "${B1[@]}" "${F8[@]}"
shape_row "qwen3-8b-fp8-rope-early" qwen3-8b $ROPE $EARLY -- "${B1[@]}" "${F8[@]}"
shape_row "qwen3-8b-fp8-rope-stage" qwen3-8b $ROPE $STAGE -- "${B1[@]}" "${F8[@]}"
shape_row "qwen3-30b-a3b-rope-early" qwen3-30b-a3b $ROPE $EARLY -- "${B1[@]}"
shape_row "qwen3-30b-a3b-rope-stage" qwen3-30b-a3b $ROPE $STAGE -- "${B1[@]}"
shape_row "qwen3-30b-a3b-rope-early-stage" qwen3-30b-a3b $ROPE $EARLY $STAGE -- "${B1[@]}"
shape_row "qwen3-30b-a3b-rope-early-stage-router-norm" qwen3-30b-a3b $ROPE $EARLY $STAGE $K.ROUTER_NORM=1 -- "${B1[@]}"
(cd "$OUT" && tar rf runs.tar ./*.log ./*.json && rm -f ./*.log ./*.json) 2>/dev/null || true

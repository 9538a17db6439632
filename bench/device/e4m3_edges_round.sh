# GPU run (issue #29, FP8 weights at batch 1; docs/engine.md, twenty-third round): an e4m3 launch's edges under PDL.
# e4m3 launches let the next kernel in first thing (token_gemv.EARLY=1) and stage no run before the wait; 16-bit ones
# let it in after their loop and stage a run (STAGE_RUNS), which paid only with that trigger. Rows: the defaults;
# e4m3 after the loop (EARLY=0); that and a run staged (STAGE_E4M3=1); a whole 4,096-column row in flight before the
# wait (E4M3_TILE=(8,1,8)), early and after the loop; the defaults again; bf16 for the ratio. qwen3-8b, random weights,
# prompt 512, 128 new tokens, each setting in its own process. `bash bench/device/e4m3_edges_round.sh`; carries .whl,
# .gpu.
source bench/device/setup.sh
B1=(--batch-sizes 1 --new-tokens 128)
K=engine.kernels.token_gemv
F8=(--quantization fp8)
shape_row "fp8-defaults" qwen3-8b $K.EARLY=1 -- "${B1[@]}" "${F8[@]}"
shape_row "fp8-loop" qwen3-8b $K.EARLY=0 -- "${B1[@]}" "${F8[@]}"
shape_row "fp8-loop-staged" qwen3-8b $K.EARLY=0 $K.STAGE_E4M3=1 -- "${B1[@]}" "${F8[@]}"
shape_row "fp8-unroll8" qwen3-8b "$K.E4M3_TILE=(8,1,8)" -- "${B1[@]}" "${F8[@]}"
shape_row "fp8-loop-unroll8" qwen3-8b $K.EARLY=0 "$K.E4M3_TILE=(8,1,8)" -- "${B1[@]}" "${F8[@]}"
shape_row "fp8-defaults-again" qwen3-8b $K.EARLY=1 -- "${B1[@]}" "${F8[@]}"
shape_row "bf16-defaults" qwen3-8b $K.EARLY=1 -- "${B1[@]}"
(cd "$OUT" && tar rf runs.tar ./*.log ./*.json && rm -f ./*.log ./*.json) 2>/dev/null || true

# GPU run (issue #29), twenty-second round: qwen3-8b with FP8 weights at batch 1 on the e4m3 tiles the round's sweep
# found best for its QKV and down projections (token_gemv.SHAPE_TILES=3: MEASURED_E4M3_TILES) against the rules
# (SHAPE_TILES=1, the default), alternating with bf16, twice; then llama31-8b (bf16) at batch 1 and 64 (64 new
# tokens), whose figures were from before the one-token kernels. Each in its own process, prompt 512.
# `bash bench/device/e4m3_tiles_round.sh`; carries .whl, .gpu.
source bench/device/setup.sh
B1=(--batch-sizes 1 --new-tokens 128)
K=engine.kernels.token_gemv
for round in 1 2; do
  shape_row "fp8-rules-$round" qwen3-8b $K.SHAPE_TILES=1 -- "${B1[@]}" --quantization fp8
  shape_row "fp8-shapes-$round" qwen3-8b $K.SHAPE_TILES=3 -- "${B1[@]}" --quantization fp8
  shape_row "bf16-$round" qwen3-8b -- "${B1[@]}"
done
shape_row llama31-8b-b1 llama31-8b -- "${B1[@]}"
ENGINE_S=100 shape_row llama31-8b-b64 llama31-8b -- --batch-sizes 64 --new-tokens 64
(cd "$OUT" && tar rf runs.tar ./*.log ./*.json && rm -f ./*.log ./*.json) 2>/dev/null || true

# GPU run (issue #29, FP8 weights at batch 1; docs/engine.md, twenty-third round). 0: the FP8 step's critical path
# with each one-token launch told apart by its grid (QKV, o, gate/up and down). 1: e4m3 launches that stage the
# token as float32, laid out for the loop's reads without bank conflicts (token_gemv.X_F32; 1 unbounded registers, 2
# bounded to 16-bit x's blocks an SM), its CUDA test first (bit for bit against 16-bit x). 2: one projection's e4m3
# tile changed at a time in the engine (token_gemv.E4M3_TILES), after call 4 changed all at once (QKV has 768 blocks
# of 8 rows where 660 fit at once; of these tiles (8,4,4), (8,1,1) and (4,1,1) fit it in one wave). qwen3-8b with
# FP8 weights at batch 1 (random weights, prompt 512, 128 new tokens, each setting in its own process), bf16 for the
# ratio. `bash bench/device/x_f32_layout_round.sh`; carries .whl, .gpu. PART=0, 1 or 2 runs one part.
source bench/device/setup.sh
B1=(--batch-sizes 1 --new-tokens 128)
K=engine.kernels.token_gemv
F8=(--quantization fp8)
if [ "${PART:-0}" = 0 ]; then
  SHAPES=qwen3-8b-fp8 bash bench/device/timeline_round.sh
fi
if [ "${PART:-1}" = 1 ]; then
  cuda_tests "float32 or runs_staged" tests/engine/test_kernels.py
  for pass in 1 2; do
    for mode in 0 1 2; do
      shape_row "fp8-xf32-$mode-$pass" qwen3-8b $K.X_F32=$mode -- "${B1[@]}" "${F8[@]}"
    done
  done
  shape_row "bf16" qwen3-8b $K.X_F32=0 -- "${B1[@]}"
fi
if [ "${PART:-2}" = 2 ]; then
  for t in "6144,4096:4,2,4" "6144,4096:8,2,4" "6144,4096:8,4,4" "6144,4096:16,1,4" "6144,4096:4,1,4" \
    "6144,4096:8,1,1" "6144,4096:4,1,1" \
    "4096,4096:4,2,4" "4096,4096:8,2,4" "4096,4096:4,1,4" "4096,4096:16,1,4" \
    "4096,12288:4,2,4" "4096,12288:8,2,4" "4096,12288:4,1,4" "4096,12288:16,1,4" "4096,12288:8,1,8" \
    "6144,4096:8,1,4"; do
    shape_row "fp8-tile-${t//[,:]/_}" qwen3-8b "$K.E4M3_TILES={(${t%%:*}):(${t#*:})}" -- "${B1[@]}" "${F8[@]}"
  done
fi
(cd "$OUT" && tar rf runs.tar ./*.log ./*.json && rm -f ./*.log ./*.json) 2>/dev/null || true

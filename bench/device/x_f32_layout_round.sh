# GPU run (issue #29, FP8 weights at batch 1; docs/engine.md, twenty-third round): e4m3 launches that stage the token
# as float32, laid out for the loop's reads without bank conflicts (token_gemv.X_F32; 1 unbounded registers, 2 bounded
# to 16-bit x's blocks an SM). First its CUDA test (bit for bit against 16-bit x), then qwen3-8b with FP8 weights at
# batch 1 (random weights, prompt 512, 128 new tokens, each setting in its own process, alternating), and bf16 for the
# ratio. `bash bench/device/x_f32_layout_round.sh`; carries .whl, .gpu.
source bench/device/setup.sh
cuda_tests "float32 or runs_staged" tests/engine/test_kernels.py
B1=(--batch-sizes 1 --new-tokens 128)
K=engine.kernels.token_gemv
F8=(--quantization fp8)
for pass in 1 2; do
  for mode in 0 1 2; do
    shape_row "fp8-xf32-$mode-$pass" qwen3-8b $K.X_F32=$mode -- "${B1[@]}" "${F8[@]}"
  done
done
shape_row "bf16" qwen3-8b $K.X_F32=0 -- "${B1[@]}"
(cd "$OUT" && tar rf runs.tar ./*.log ./*.json && rm -f ./*.log ./*.json) 2>/dev/null || true

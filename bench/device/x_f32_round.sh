# GPU run (issue #29, FP8 weights at batch 1): e4m3 launches of one token's matmul with the token staged in shared
# memory as float32 (engine.kernels.token_gemv.X_F32=1) or as it is (0). 1. the CUDA test of the kernel against the
# float32 product; 2. qwen3-8b with FP8 weights at batch 1 (prompt 512, 128 new tokens), each setting in its own
# process, alternating, twice. `bash bench/device/x_f32_round.sh`; carries .whl, .gpu.
source bench/device/setup.sh
cuda_tests "cuda_matmul_matches" tests/engine/test_kernels.py
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b >/dev/null
for round in 1 2; do
  for xf in 0 1; do
    ab_bench "qwen3-8b-fp8-xf$xf-$round" /tmp/shapes/qwen3-8b engine.kernels.token_gemv.X_F32=$xf -- --batch-sizes 1 \
      --new-tokens 128 --quantization fp8 | grep -E "^ +1 \|" | sed "s/^/qwen3-8b-fp8 xf32=$xf $round /" || true
  done
done
(cd "$OUT" && tar rf runs.tar ./*.log ./*.json && rm -f ./*.log ./*.json) 2>/dev/null || true

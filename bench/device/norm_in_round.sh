# GPU run (issue #29, qwen3-30b-a3b at 50% of its batch-1 roofline): one token's residual add and RMSNorm done by the
# blocks of the layer after them as they stage the token (token_gemv's NORM_IN: the QKV projection, the gate/up
# projection, the MoE router) against their own Triton launch (ENGINE_TOKEN_NORM=triton). 1. the CUDA tests of it;
# 2. bench/device/norm_in_bench.py (chains of layers); 3. at batch 1 (prompt 512, 128 new tokens) each shape of
# SHAPES (qwen3-30b-a3b qwen3-8b) with ENGINE_TOKEN_NORM=cuda, then =triton, each in its own process.
# `bash bench/device/norm_in_round.sh`; carries .whl, .gpu.
source bench/device/setup.sh
cuda_tests "norm_before or wide_enough" tests/engine/test_kernels.py tests/engine/test_moe.py \
  tests/engine/test_model_families.py
python3 bench/device/norm_in_bench.py --json "$OUT/norm-in-bench.json" 2>&1 | grep -v -i warn || true
for shape in ${SHAPES:-qwen3-30b-a3b qwen3-8b}; do
  python3 bench/device/shape_config.py "$shape" "/tmp/shapes/$shape" >/dev/null
  for mode in cuda triton; do
    ENGINE_TOKEN_NORM=$mode ENGINE_S=80 ab_bench "$shape-norm-in-$mode" "/tmp/shapes/$shape" -- --batch-sizes 1 \
      --new-tokens 128 | sed "s/^/$shape $mode /" || true
    (cd "$OUT" && tar rf logs.tar ./*.log && rm -f ./*.log)  # at most 8 files come back
  done
done

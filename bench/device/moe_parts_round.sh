# GPU run (issue #29, qwen3-30b-a3b at 50% of its batch-1 roofline): one token's narrow weights (the o projection,
# 2,048 rows) whole on the CUDA one-token kernel against split along K on Triton's (engine.kernels.gemv.parts_for,
# SPLIT_ONE_TOKEN). 1. the CUDA tests of the MoE and one-token kernels; 2. qwen3-30b-a3b at batch 1 (prompt 512),
# each setting in its own process, alternating, twice. `bash bench/device/moe_parts_round.sh`; carries .whl, .gpu.
source bench/device/setup.sh
cuda_tests "cuda or router or fused_moe or takes_what or split or paged or parts" tests/engine/test_moe.py tests/engine/test_kernels.py
python3 bench/device/shape_config.py qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b >/dev/null
S=engine.kernels.gemv.SPLIT_ONE_TOKEN
for round in 1 2; do
  for split in 1 0; do
    ENGINE_S=80 ab_bench "ab-split$split-$round" /tmp/shapes/qwen3-30b-a3b $S=$split -- --batch-sizes 1 \
      --new-tokens 128 | sed "s/^/split$split $round /" || true
  done
done
(cd "$OUT" && tar czf runs.tgz ./*.log && rm -f ./*.log)

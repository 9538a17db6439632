# GPU run (issue #29, qwen3-30b-a3b at 50% of its batch-1 roofline): one token's MoE router and routing in one launch
# on the CUDA one-token kernel (engine/kernels/token_gemv.cu, ROUTER) against the Triton router and routing. (Its
# first run, at dfd03a3, also timed the experts' down projection at 2 and 4 rows a warp: no change, and that knob is
# gone.) 1. the CUDA tests of the MoE and one-token kernels; 2.
# qwen3-30b-a3b at batch 1 (prompt 512), each setting in its own process, alternating; 3. where the step goes, kernel
# by kernel, with PDL off (kernels not overlapping). `bash bench/device/moe_router_round.sh`; carries .whl and .gpu.
source bench/device/setup.sh
cuda_tests "cuda or router or fused_moe or takes_what or split or paged" tests/engine/test_moe.py tests/engine/test_kernels.py
python3 bench/device/shape_config.py qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b >/dev/null
M=engine.models.moe.ROUTER_TOKEN
for round in 1 2; do
  for fused in 0 1; do
    ENGINE_S=80 ab_bench "ab-router$fused-$round" /tmp/shapes/qwen3-30b-a3b $M=$fused -- --batch-sizes 1 \
      --new-tokens 128 | sed "s/^/router$fused $round /" || true
  done
done
ENGINE_PDL=0 timeout 100 python3 -m bench.engine.throughput --model /tmp/shapes/qwen3-30b-a3b --load-format dummy \
  --device cuda --prompt-len 512 --new-tokens 32 --batch-sizes 1 --runs 1 --no-reference --profile \
  --json "$OUT/qwen3-30b-a3b-nopdl-profile.json" 2>&1 | grep -v -i warn | tail -24 || true
(cd "$OUT" && tar czf runs.tgz ./*.log ./ab-*.json && rm -f ./*.log ./ab-*.json)

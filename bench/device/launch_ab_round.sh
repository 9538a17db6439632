# GPU run (issue #29): which of the second batch-1 change's parts moves qwen3-30b-a3b (one call, alternating):
# RoPE + KV store a program per (token, KV head) or per token (ROPE_GROUPS_TOKENS=0), routing on one warp or four
# (ROUTE_WARPS); then a batch-1 step by kernel with PDL off. `bash bench/device/launch_ab_round.sh`; carries .whl, .gpu.
source bench/device/setup.sh
python3 bench/device/shape_config.py qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b
ab() {  # name constants...
  local name=$1
  shift
  timeout 120 python3 bench/device/launch_ab.py "$@" -- --model /tmp/shapes/qwen3-30b-a3b --load-format dummy \
    --device cuda --no-reference --prompt-len 512 --new-tokens 64 --runs 3 --batch-sizes 1 --json "$OUT/$name.json" \
    2>&1 | grep -E "^set|engine batch" || true
}
T=engine.kernels.triton_ops.ROPE_GROUPS_TOKENS
W=engine.kernels.fused_moe.ROUTE_WARPS
ab ab1-now
ab ab2-rope-token $T=0
ab ab3-warps4 $W=4
ab ab4-rope-token-warps4 $T=0 $W=4
ab ab5-now-again
ENGINE_S=100 ENGINE_PDL=0 engine_bench ab6-nopdl-profile /tmp/shapes/qwen3-30b-a3b --prompt-len 512 --new-tokens 32 \
  --batch-sizes 1 --profile | grep -E "route|rope|norm|gemm|gemv|attention|merge|decode step"

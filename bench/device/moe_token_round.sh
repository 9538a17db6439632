# GPU run (issue #29, qwen3-30b-a3b at 50% of its batch-1 roofline): one token's MoE experts on the CUDA one-token
# kernel (ENGINE_MOE_TOKEN_GEMV=cuda, engine/kernels/token_gemv.cu) against the fused MoE's grouped GEMMs. 1. the CUDA
# tests of the one-token kernel and the MoE kernels; 2. qwen3-30b-a3b at batch 1 (prompt 512), each setting in its own
# process, twice alternating. `bash bench/device/moe_token_round.sh`; carries .whl and .gpu. About 6 minutes.
source bench/device/setup.sh
cuda_tests "cuda_fp8 or fp8_cache or cuda_matmul or cuda_experts or takes_what or split or paged or fused_moe" tests/engine/test_moe.py tests/engine/test_kernels.py
python3 bench/device/shape_config.py qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b >/dev/null
for round in 1 2; do
  for m in triton cuda; do
    ENGINE_MOE_TOKEN_GEMV=$m ENGINE_S=${ENGINE_S:-110} engine_bench qwen3-30b-a3b-b1-moe-$m-$round \
      /tmp/shapes/qwen3-30b-a3b --prompt-len 512 --batch-sizes 1 --new-tokens 128 | grep -E "^ +1 \|" \
      | sed "s/^/$m $round /" || true
  done
done
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)

# GPU run (issue #29, batch 1): the RMS norm folded into the linear layer after it (token_gemv.cu's NORM:
# engine.kernels.token_gemv.FUSE_NORM=1) or launched apart (0); and e4m3 launches with x staged in halves
# (X_HALVES=1) or as it is (0). 1. the CUDA tests of the one-token matmul (with and without its norm), the norm, graph
# replays and the model families in bf16, those last two again with the norm folded in; 2. qwen3-8b (bf16, FP8
# weights) and qwen3-30b-a3b at batch 1 (prompt 512,
# 128 new tokens), each setting in its own process, ROUNDS times (1).
# `bash bench/device/norm_gemv_round.sh`; carries .whl, .gpu.
source bench/device/setup.sh
cuda_tests "token or norm or graph_replay or bfloat16" tests/engine/test_kernels.py tests/engine/test_model_families.py
# The engine's CUDA tests once more with the norms folded in (FUSE_NORM is off until measured), the MoE ones too.
ENGINE_TEST_DEVICE=cuda timeout 240 python3 bench/device/launch_ab.py engine.kernels.token_gemv.FUSE_NORM=1 -- -m pytest \
  -q -p no:cacheprovider -k "(graph_replay or bfloat16 or router or one_token) and not sampler" tests/engine/test_kernels.py \
  tests/engine/test_model_families.py tests/engine/test_moe.py 2>&1 | grep -v -i "warn\|^ *$" | tail -15 | tee "$OUT/cuda-tests-fused.txt" || true
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b >/dev/null
python3 bench/device/shape_config.py qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b >/dev/null
B1=(--batch-sizes 1 --new-tokens 128)
for round in $(seq "${ROUNDS:-1}"); do
  for fuse in 0 1; do
    ab_bench "qwen3-8b-fuse$fuse-$round" /tmp/shapes/qwen3-8b engine.kernels.token_gemv.FUSE_NORM=$fuse -- "${B1[@]}" \
      | grep -E "^ +1 \|" | sed "s/^/qwen3-8b fuse=$fuse $round /" || true
    ab_bench "qwen3-8b-fp8-fuse$fuse-$round" /tmp/shapes/qwen3-8b engine.kernels.token_gemv.FUSE_NORM=$fuse -- \
      "${B1[@]}" --quantization fp8 | grep -E "^ +1 \|" | sed "s/^/qwen3-8b-fp8 fuse=$fuse $round /" || true
  done
  ab_bench "qwen3-8b-fp8-halves-$round" /tmp/shapes/qwen3-8b engine.kernels.token_gemv.X_HALVES=1 -- "${B1[@]}" \
    --quantization fp8 | grep -E "^ +1 \|" | sed "s/^/qwen3-8b-fp8 fuse=1 halves=1 $round /" || true
  for fuse in 0 1; do
    ab_bench "qwen3-30b-a3b-fuse$fuse-$round" /tmp/shapes/qwen3-30b-a3b engine.kernels.token_gemv.FUSE_NORM=$fuse -- \
      "${B1[@]}" | grep -E "^ +1 \|" | sed "s/^/qwen3-30b-a3b fuse=$fuse $round /" || true
  done
done
(cd "$OUT" && tar rf runs.tar ./*.log ./*.json && rm -f ./*.log ./*.json) 2>/dev/null || true

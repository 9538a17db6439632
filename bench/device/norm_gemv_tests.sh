# GPU run (issue #29): the CUDA tests of the twenty-first round's kernels, before norm_gemv_round.sh measures them.
# 1. the one-token matmul (with and without its norm; x as it is and in halves; runs staged before the wait), the
# norm, the rope in the attention kernel, graph replays and the model families in bf16, on the defaults; 2. graph
# replays, the model families, the MoE router and the one-token MoE tests again with every candidate on
# (engine.kernels.token_gemv.FUSE_NORM=7: the norms of all three kinds folded; STAGE_RUNS=1;
# engine.kernels.triton_ops.ROPE_IN_ATTENTION=1 and ATTENTION_TRIGGER=1: the attention lets the next kernel in first
# thing), which were off until measured. The round also tested the attention's first tile read before the PDL wait
# (PREFETCH_KV=1 and its tests); that lost 2% and was taken out after the round (docs/engine.md, twenty-first round).
# `bash bench/device/norm_gemv_tests.sh`; carries .whl, .gpu.
source bench/device/setup.sh
cuda_tests "token or norm or graph_replay or bfloat16 or rope or staged" tests/engine/test_kernels.py \
  tests/engine/test_model_families.py
ENGINE_TEST_DEVICE=cuda timeout 300 python3 bench/device/launch_ab.py engine.kernels.token_gemv.FUSE_NORM=7 \
  engine.kernels.token_gemv.STAGE_RUNS=1 \
  engine.kernels.triton_ops.ROPE_IN_ATTENTION=1 engine.kernels.triton_ops.ATTENTION_TRIGGER=1 -- \
  -m pytest -q -p no:cacheprovider -k "(graph_replay or bfloat16 or router or one_token) and not sampler" \
  tests/engine/test_kernels.py tests/engine/test_model_families.py tests/engine/test_moe.py 2>&1 \
  | grep -v -i "warn\|^ *$" | tail -20 | tee "$OUT/cuda-tests-fused.txt" || true

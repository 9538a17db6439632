# GPU run (issue #29): qwen3-30b-a3b decode with three launches fewer per MoE layer at up to 16 tokens (the router on
# the skinny-matmul kernel, routing and alignment in one program, the sum over a token's experts folded into the next
# residual add). 1. the CUDA tests of the kernels touched; 2. the skinny-matmul tiles of that model's dense layers and
# router, streamed from HBM (fp8_tune.py --shapes qwen3-30b-a3b); 3. the engine at batch 1 and 64 with the tiles of
# today's rule, then with the swept ones (ENGINE_GEMV_TILES); 4. a batch-1 step by kernel with PDL off (with PDL on a
# kernel's time includes its wait for the one before).
# `bash bench/device/moe_launches_round.sh`; carries .whl, .gpu and .old. About 7 minutes.
source bench/device/setup.sh
ENGINE_TEST_DEVICE=cuda ENGINE_TEST_DTYPE=bfloat16 timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_moe.py tests/engine/test_kernels.py -k "moe or route or norm or famil or graph" \
  --deselect tests/engine/test_kernels.py::test_sampler_features_on_the_kernels_and_graphs \
  2>&1 | tee "$OUT/cuda-tests-moe-launches.txt" | tail -3 || true
timeout ${TUNE_S:-120} python3 bench/device/fp8_tune.py --only gemv --kinds bf16 --shapes qwen3-30b-a3b --seconds 90 \
  --json "$OUT/moe-dense-tiles.json" --tiles "$OUT/moe-dense-tiles-table.json" 2>&1 | grep "^gemv" || true
python3 bench/device/shape_config.py qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b
ENGINE_S=220 engine_bench qwen3-30b-a3b-launches /tmp/shapes/qwen3-30b-a3b --prompt-len 512 --new-tokens 64 --batch-sizes 1 64 --runs 3
# The code before (`git archive ca76503 engine bench | tar -x -C .old`, carried) in the same call: engine figures move
# 2-3% between calls.
(cd .old && PYTHONPATH=/tmp/site:$PWD ENGINE_S=150 engine_bench qwen3-30b-a3b-before /tmp/shapes/qwen3-30b-a3b \
  --prompt-len 512 --new-tokens 64 --batch-sizes 1 --runs 3)
ENGINE_S=150 ENGINE_GEMV_TILES="$OUT/moe-dense-tiles-table.json" engine_bench qwen3-30b-a3b-launches-tiles /tmp/shapes/qwen3-30b-a3b \
  --prompt-len 512 --new-tokens 64 --batch-sizes 1 --runs 3
ENGINE_PDL=0 engine_bench qwen3-30b-a3b-launches-nopdl-profile /tmp/shapes/qwen3-30b-a3b --prompt-len 512 \
  --new-tokens 32 --batch-sizes 1 --profile
decode_figures

# GPU run (issue #29): a MoE router of a decode step in float32 parts along K, summed by the routing program
# (engine.models.moe.ROUTER_PARTS; Qwen3-30B-A3B's router is 4 row tiles of 32 on 132 SMs). CUDA tests of the MoE
# kernels, PDL and the skinny matmuls' parts; qwen3-30b-a3b at batch 1 with the router in parts against without,
# each its own process, twice. `bash bench/device/router_parts_round.sh`; carries .whl and .gpu. About 7 minutes.
source bench/device/setup.sh
set +e
ENGINE_TEST_DEVICE=cuda ENGINE_TEST_DTYPE=bfloat16 timeout ${TESTS_S:-90} python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_moe.py tests/engine/test_pdl.py tests/engine/test_kernels.py -k "moe or route or pdl or parts" \
  2>&1 | tee "$OUT/cuda-tests-router-parts.txt" | tail -3
python3 bench/device/shape_config.py qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b
for p in 1 0 1 0; do
  ab_bench qwen3-30b-a3b-b1-router-parts$p-$RANDOM /tmp/shapes/qwen3-30b-a3b engine.models.moe.ROUTER_PARTS=$p -- \
    --runs 3 --new-tokens 64 --batch-sizes 1
done
decode_figures
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json ./*.txt && rm -f ./*.log ./*.json ./*.txt)

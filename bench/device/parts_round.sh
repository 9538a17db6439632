# GPU run (issue #29): a narrow skinny matmul cut along K into parts that the next residual add + RMSNorm sums
# (engine.kernels.gemv.parts_for; Qwen3-30B-A3B's o projection: 64 row tiles on 132 SMs). CUDA tests of the skinny
# matmuls, the norms, the MoE kernels and PDL; qwen3-30b-a3b at batch 1 with parts (MAX_PARTS=4) against without
# (MAX_PARTS=1), each its own process, twice; a batch-1 step by kernel with PDL off, both ways.
# `bash bench/device/parts_round.sh`; carries .whl and .gpu. About 8 minutes.
source bench/device/setup.sh
set +e
ENGINE_TEST_DEVICE=cuda ENGINE_TEST_DTYPE=bfloat16 timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_kernels.py tests/engine/test_moe.py tests/engine/test_pdl.py \
  -k "parts or skinny or one_token or norm or rope or moe or route or famil or pdl or wait or launch" \
  2>&1 | tee "$OUT/cuda-tests-parts.txt" | tail -3
python3 bench/device/shape_config.py qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b
for p in 4 1 4 1; do
  ab_bench qwen3-30b-a3b-b1-parts$p-$RANDOM /tmp/shapes/qwen3-30b-a3b engine.kernels.gemv.MAX_PARTS=$p -- \
    --runs 3 --new-tokens 64 --batch-sizes 1
done
for p in 4 1; do
  ENGINE_PDL=0 ab_bench qwen3-30b-a3b-b1-parts$p-profile /tmp/shapes/qwen3-30b-a3b engine.kernels.gemv.MAX_PARTS=$p -- \
    --runs 1 --new-tokens 32 --batch-sizes 1 --profile
  grep -E "gemv|norm|decode step" "$OUT/qwen3-30b-a3b-b1-parts$p-profile.log" | head -12
done
decode_figures
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json ./*.txt && rm -f ./*.log ./*.json ./*.txt)

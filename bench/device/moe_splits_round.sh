# GPU run (issue #29, qwen3-30b-a3b at 50% of its batch-1 roofline): 1. the CUDA tests of the one-token router (its
# last block now counts with one acquire-release atomic after a barrier, no fence in every thread); 2. qwen3-30b-a3b
# at batch 1 (prompt 512, 128 new tokens) by the decode attention's split cap (engine.kernels.MAX_DECODE_SPLITS: 64,
# the default, 16 and 8; a graph captured for the longest context splits 640 keys into about 20 one-tile programs
# and a merge of 20 partials under 64), each in its own process. `bash bench/device/moe_splits_round.sh`; carries
# .whl, .gpu.
source bench/device/setup.sh
cuda_tests "router or one_token or wide_enough" tests/engine/test_moe.py tests/engine/test_model_families.py
python3 bench/device/shape_config.py qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b >/dev/null
for splits in ${SPLITS:-64 16 8}; do
  ENGINE_S=80 ab_bench "moe-splits$splits" /tmp/shapes/qwen3-30b-a3b engine.kernels.MAX_DECODE_SPLITS=$splits -- \
    --batch-sizes 1 --new-tokens 128 | sed "s/^/splits$splits /" || true
done
(cd "$OUT" && tar czf runs.tgz ./*.log && rm -f ./*.log)

# GPU run of 2026-12-02 after merging three engine branches (issues #29 and #30), one call of at most 10 minutes:
# 1. the CUDA tests of what they change: the head-major KV cache (attention, KV store, sparse), the fused decode
#    kernels (norm in the skinny matmul, MoE routing + align, the MoE down projection's expert sum), P/D over ipc
#    with early offers (KV copied as prefill chunks finish);
# 2. decode attention alone, head-major against slot-major, bf16 and FP8 caches (bench/device/fp8_tune.py);
# 3. qwen3-8b and qwen3-30b-a3b at batch 1 and 64.
# As run on 2026-12-02 (at be955b1) step 3 ran each shape with the fused decode kernels off and on
# (ENGINE_FUSED_DECODE=0/1); they were slower and were removed (33fb8aa), so it now runs each shape once.
# The longer rounds: bench/device/fp8kv_round.sh, pd_one_gpu_rows.sh with EARLY_AB=1.
# `bash bench/device/merge_round.sh`; carries .whl, .gpu and .deb.
source bench/device/setup.sh
source bench/device/mooncake_cuda.sh || exit 1
set +e
ENGINE_TEST_DEVICE=cuda ENGINE_TEST_DTYPE=bfloat16 timeout ${TESTS_S:-230} python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_fused_decode.py tests/engine/test_kernels.py tests/engine/test_moe.py \
  tests/engine/test_engine_attention.py tests/engine/test_sparse.py tests/test_pd_overlap.py 2>&1 \
  | tee "$OUT/cuda-tests-merge.txt" | grep -E "passed|failed|FAILED|Error" | tail -12
timeout ${TUNE_S:-100} python3 bench/device/fp8_tune.py --only attention --seconds ${PART_S:-80} \
  --json "$OUT/attention-layouts.json" 2>&1 | grep -v -i warn | tee "$OUT/attention-layouts.log" \
  | grep -v "^attention [0-9]" | tail -12
for shape in qwen3-8b qwen3-30b-a3b; do
  python3 bench/device/shape_config.py $shape /tmp/shapes/$shape
  timeout ${ENGINE_S:-55} python3 -m bench.engine.throughput --model /tmp/shapes/$shape \
    --load-format dummy --device cuda --prompt-len 512 --new-tokens 64 --batch-sizes 1 64 --runs 1 --no-reference \
    --json "$OUT/$shape.json" 2>&1 | grep -v -i warn | tail -2
done

# GPU run (issue #29, batch-1 targets): how one token's matmul reads what the kernel before wrote (token_gemv.LOADS:
# 0 the read-only path, which ptxas may move above the PDL wait, to measure; 1 ld.global.cg; 2 ld.global), with its
# first chunks requested before the wait (PIN_LOADS 1: a bulk prefetch, 2: a fence) or not (0), and e4m3 launches
# letting the next kernel in first thing (EARLY=4). 1. CUDA tests of the kernel, the MoE and the model families;
# 2. qwen3-30b-a3b at batch 1 (prompt 512, 128 new tokens) by "LOADS,PIN"; 3. qwen3-8b bf16 and FP8 weights at
# batch 1 on the defaults. `bash bench/device/pdl_loads_round.sh`; carries .whl, .gpu.
source bench/device/setup.sh
cuda_tests "token or gemv or router or one_token or moe or qwen3" tests/engine/test_kernels.py tests/engine/test_moe.py \
  tests/engine/test_model_families.py
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b >/dev/null
python3 bench/device/shape_config.py qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b >/dev/null
for pair in ${MOE:-2,0 0,0 1,0 2,2 0,2 2,1 2,0 2,2}; do
  loads=${pair%,*} pin=${pair#*,}
  ENGINE_S=90 ab_bench "qwen3-30b-a3b-loads$loads-pin$pin" /tmp/shapes/qwen3-30b-a3b engine.kernels.token_gemv.LOADS="$loads" \
    engine.kernels.token_gemv.PIN_LOADS="$pin" -- --batch-sizes 1 --new-tokens 128 | sed "s/^/moe loads$loads pin$pin /" || true
done
for q in none fp8; do
  extra=(); [ $q = fp8 ] && extra=(--quantization fp8)
  ENGINE_S=90 ab_bench "qwen3-8b-$q-defaults" /tmp/shapes/qwen3-8b -- --batch-sizes 1 --new-tokens 128 "${extra[@]}" \
    | sed "s/^/qwen3-8b $q defaults /" || true
done
(cd "$OUT" && tar rf runs.tar ./*.log ./*.json && rm -f ./*.log ./*.json)

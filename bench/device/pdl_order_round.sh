# GPU run (issue #29, batch-1 targets): the order of one token's matmul around its PDL wait. PIN_LOADS=1 keeps the
# first weight chunks before the wait in the compiled code (ptxas otherwise schedules the wait first); EARLY lets the
# next kernel in first thing for launches of e4m3 weights (1), 16-bit ones (2), all (3) or none (0). 1. the CUDA tests
# of the kernel, the MoE and the model families in bf16; 2. qwen3-8b (bf16, FP8 weights) and qwen3-30b-a3b at batch 1
# (prompt 512, 128 new tokens) by "PIN_LOADS,EARLY", each in its own process. `bash bench/device/pdl_order_round.sh`;
# carries .whl, .gpu. DENSE, MOE, FP8 pick the pairs (docs/engine.md, nineteenth round, ran earlier forms of it).
source bench/device/setup.sh
cuda_tests "token or gemv or router or one_token or wide_enough or bfloat16" tests/engine/test_kernels.py \
  tests/engine/test_moe.py tests/engine/test_model_families.py
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b >/dev/null
python3 bench/device/shape_config.py qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b >/dev/null
run() {  # NAME MODEL PIN,EARLY ARGS...
  local name=$1 model=$2 pin=${3%,*} early=${3#*,}
  shift 3
  ENGINE_S=90 ab_bench "$name-pin$pin-early$early" "$model" engine.kernels.token_gemv.PIN_LOADS="$pin" \
    engine.kernels.token_gemv.EARLY="$early" -- --batch-sizes 1 --new-tokens 128 "$@" \
    | sed "s/^/$name pin$pin early$early /" || true
}
for pair in ${DENSE:-0,1 1,1}; do run qwen3-8b /tmp/shapes/qwen3-8b "$pair"; done
for pair in ${MOE:-0,1 1,1 1,3}; do run qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b "$pair"; done
for pair in ${FP8:-1,0 1,1}; do run qwen3-8b-fp8 /tmp/shapes/qwen3-8b "$pair" --quantization fp8; done
(cd "$OUT" && tar rf runs.tar ./*.log ./*.json && rm -f ./*.log ./*.json)

# GPU run (issue #29, batch-1 targets): where one token's matmul stands under PDL. ptxas moves token_gemv.cu's bare
# griddepcontrol.wait above the weight loads, so no chunk is in flight before the wait; PIN_LOADS keeps them before it
# (1: a bulk prefetch, 2: a fence). EARLY lets the next kernel in first thing (1: 16-bit linear layers, 2: and the MoE
# experts, 3: everything).
# 1. the CUDA tests of the one-token kernel; 2. qwen3-8b (bf16, FP8 weights) and qwen3-30b-a3b at batch 1 (prompt 512,
# 128 new tokens) by PIN_LOADS and EARLY, each in its own process. `bash bench/device/pdl_order_round.sh`; carries
# .whl, .gpu. DENSE, MOE, FP8 pick the "PIN,EARLY" pairs.
source bench/device/setup.sh
cuda_tests "token or gemv or router or one_token" tests/engine/test_kernels.py tests/engine/test_moe.py
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b >/dev/null
python3 bench/device/shape_config.py qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b >/dev/null
run() {  # NAME MODEL PIN,EARLY ARGS...
  local name=$1 model=$2 pin=${3%,*} early=${3#*,} t0=$SECONDS
  shift 3
  ENGINE_S=90 ab_bench "$name-pin$pin-early$early" "$model" engine.kernels.token_gemv.PIN_LOADS="$pin" \
    engine.kernels.token_gemv.EARLY="$early" -- --batch-sizes 1 --new-tokens 128 "$@" | sed "s/^/$name pin$pin early$early /" || true
  echo "took $((SECONDS - t0)) s"
}
for pair in ${DENSE:-0,0 1,0 0,1 1,1}; do run qwen3-8b /tmp/shapes/qwen3-8b "$pair"; done
for pair in ${MOE:-0,0 1,0 0,1 1,1 1,2}; do run qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b "$pair"; done
for pair in ${FP8:-0,0 1,0 1,3}; do run qwen3-8b-fp8 /tmp/shapes/qwen3-8b "$pair" --quantization fp8; done
(cd "$OUT" && tar rf runs.tar ./*.log ./*.json && rm -f ./*.log ./*.json)

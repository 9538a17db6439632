# GPU run (issue #29, batch-1 targets): one token's matmul asks the rest of its rows into L2 before its PDL wait
# (engine.kernels.token_gemv.AHEAD: 0 nothing, 1 a bulk prefetch a row, 2 a line a lane), so the blocks placed while
# attention or a norm runs stream their rows while HBM would idle. 1. the CUDA tests of the one-token kernel;
# 2. qwen3-8b (bf16, then FP8 weights) and qwen3-30b-a3b at batch 1 (prompt 512, 128 new tokens) by AHEAD, each in
# its own process. `bash bench/device/l2_ahead_round.sh`; carries .whl, .gpu. MODES, FP8_MODES, MOE_MODES pick runs.
source bench/device/setup.sh
cuda_tests "token or gemv or router or one_token" tests/engine/test_kernels.py tests/engine/test_moe.py
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b >/dev/null
python3 bench/device/shape_config.py qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b >/dev/null
run() {  # NAME MODEL AHEAD ARGS...
  local name=$1 model=$2 ahead=$3 t0=$SECONDS
  shift 3
  ab_bench "$name" "$model" engine.kernels.token_gemv.AHEAD="$ahead" -- --batch-sizes 1 --new-tokens 128 "$@" \
    | sed "s/^/$name /" || true
  echo "$name took $((SECONDS - t0)) s"
}
for a in ${MODES:-0 1 2}; do ENGINE_S=80 run "qwen3-8b-ahead$a" /tmp/shapes/qwen3-8b "$a"; done
for a in ${MOE_MODES:-0 1}; do ENGINE_S=90 run "qwen3-30b-a3b-ahead$a" /tmp/shapes/qwen3-30b-a3b "$a"; done
for a in ${FP8_MODES:-0 1}; do
  ENGINE_S=80 run "qwen3-8b-fp8-ahead$a" /tmp/shapes/qwen3-8b "$a" --quantization fp8
done
(cd "$OUT" && tar rf logs.tar ./*.log && rm -f ./*.log)

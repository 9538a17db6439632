# GPU run (issue #29, batch-1 targets): a decode step's RMS norms on the CUDA kernel (engine/kernels/token_norm.cu,
# the weight asked for before the PDL wait) against the Triton kernel, on qwen3-8b (bf16, FP8 weights) and
# qwen3-30b-a3b at batch 1 (prompt 512, 128 new tokens), each in its own process, alternating, then the critical path
# of a step on the CUDA norm. 1. the CUDA tests of the norm and the one-token kernels.
# `bash bench/device/norm_round.sh`; carries .whl, .gpu. ROUNDS: how many A/B pairs (2).
source bench/device/setup.sh
cuda_tests "norm or token or graph_replay" tests/engine/test_kernels.py
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b >/dev/null
python3 bench/device/shape_config.py qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b >/dev/null
run() {  # NAME MODEL NORM ROUND ARGS...
  local name=$1 model=$2 norm=$3 round=$4
  shift 4
  ENGINE_TOKEN_NORM=$norm ENGINE_S=90 engine_bench "$name-$norm-$round" "$model" --prompt-len 512 --batch-sizes 1 \
    --new-tokens 128 "$@" | grep -E "^ +1 \|" | sed "s/^/$name $norm $round /" || true
}
for round in $(seq "${ROUNDS:-2}"); do
  for norm in triton cuda; do
    run qwen3-8b /tmp/shapes/qwen3-8b $norm "$round"
    run qwen3-8b-fp8 /tmp/shapes/qwen3-8b $norm "$round" --quantization fp8
    run qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b $norm "$round"
  done
done
SHAPES="${TIMELINE:-qwen3-8b}" bash bench/device/timeline_round.sh 2>&1 | grep -v "^NVIDIA\|^torch" || true
(cd "$OUT" && tar rf runs.tar ./*.log ./*.json && rm -f ./*.log ./*.json) 2>/dev/null || true

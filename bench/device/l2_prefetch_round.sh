# GPU run (issue #29, batch-1 targets): the rope-and-store kernel asks for the first L2_PREFETCH_BYTES of the layer's
# output projection into L2 while the attention runs (engine.kernels.triton_ops.L2_PREFETCH_BYTES; 0: none). 1. the
# CUDA tests of the rope, the norms, graph replay and the model families in bf16; 2. qwen3-8b (bf16, FP8 weights) and
# qwen3-30b-a3b at batch 1 (prompt 512, 128 new tokens) by bytes (MiB), each in its own process; 3. the critical path
# of a qwen3-8b step on the default. `bash bench/device/l2_prefetch_round.sh`; carries .whl, .gpu. DENSE, FP8, MOE:
# the MiB to measure.
source bench/device/setup.sh
cuda_tests "rope or norm or graph_replay or bfloat16" tests/engine/test_kernels.py tests/engine/test_model_families.py
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b >/dev/null
python3 bench/device/shape_config.py qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b >/dev/null
run() {  # NAME MODEL MIB ARGS...
  local name=$1 model=$2 mib=$3
  shift 3
  ab_bench "$name-pf$mib" "$model" engine.kernels.triton_ops.L2_PREFETCH_BYTES=$((mib << 20)) -- --batch-sizes 1 \
    --new-tokens 128 "$@" | grep -E "^ +1 \|" | sed "s/^/$name pf${mib}MiB /" || true
}
for mib in ${DENSE:-0 8 16 24 32}; do run qwen3-8b /tmp/shapes/qwen3-8b "$mib"; done
for mib in ${FP8:-0 16}; do run qwen3-8b-fp8 /tmp/shapes/qwen3-8b "$mib" --quantization fp8; done
for mib in ${MOE:-0 16}; do run qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b "$mib"; done
(cd "$OUT" && tar rf runs.tar ./*.log ./*.json && rm -f ./*.log ./*.json) 2>/dev/null || true
SHAPES="${TIMELINE:-qwen3-8b}" bash bench/device/timeline_round.sh 2>&1 | grep -v "^NVIDIA\|^torch" || true

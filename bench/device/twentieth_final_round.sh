# GPU run (issue #29): the twentieth round's final code on its defaults (the decode step's norms on the CUDA kernel,
# 16-bit weights' measured tiles). 1. the CUDA tests of the kernels, the norm and the model families in bf16; 2.
# qwen3-8b (bf16, FP8 weights) and qwen3-30b-a3b at batch 1 (prompt 512, 128 new tokens), each in its own process,
# twice. `bash bench/device/twentieth_final_round.sh`; carries .whl, .gpu.
source bench/device/setup.sh
cuda_tests "token or norm or bfloat16" tests/engine/test_kernels.py tests/engine/test_model_families.py
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b >/dev/null
python3 bench/device/shape_config.py qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b >/dev/null
for round in 1 2; do
  ENGINE_S=90 engine_bench "qwen3-8b-$round" /tmp/shapes/qwen3-8b --prompt-len 512 --batch-sizes 1 --new-tokens 128 \
    | grep -E "^ +1 \|" | sed "s/^/qwen3-8b $round /" || true
  ENGINE_S=90 engine_bench "qwen3-8b-fp8-$round" /tmp/shapes/qwen3-8b --prompt-len 512 --batch-sizes 1 \
    --new-tokens 128 --quantization fp8 | grep -E "^ +1 \|" | sed "s/^/qwen3-8b-fp8 $round /" || true
  ENGINE_S=90 engine_bench "qwen3-30b-a3b-$round" /tmp/shapes/qwen3-30b-a3b --prompt-len 512 --batch-sizes 1 \
    --new-tokens 128 | grep -E "^ +1 \|" | sed "s/^/qwen3-30b-a3b $round /" || true
done
(cd "$OUT" && tar rf runs.tar ./*.log ./*.json && rm -f ./*.log ./*.json) 2>/dev/null || true

# GPU run (issue #29, speed, second round): bench.engine.throughput with the skinny kernels on: llama31-8b against transformers
# eager (prompt 512 at batch 1/64, 4,096 at batch 1; random weights drawn on the device, --load-format dummy),
# qwen3-8b bf16 against FP8 weights (batch 1/64) and bf16 against FP8 KV (batch 256, 2K context).
# `bash bench/device/decode_speed.sh`; carries .whl and .gpu (setup.sh).
source bench/device/setup.sh
python3 bench/device/shape_config.py llama31-8b /tmp/shapes/llama31-8b
timeout 150 python3 -m bench.engine.throughput --model /tmp/shapes/llama31-8b --load-format dummy --device cuda \
  --prompt-len 512 --new-tokens 64 --batch-sizes 1 64 --runs 2 --json "$OUT/llama31-8b-512.json" 2>&1 \
  | grep -v -i warn | tail -6 || true
timeout 80 python3 -m bench.engine.throughput --model /tmp/shapes/llama31-8b --load-format dummy --device cuda \
  --prompt-len 4096 --new-tokens 16 --batch-sizes 1 --runs 2 --json "$OUT/llama31-8b-4096.json" 2>&1 \
  | grep -v -i warn | tail -4 || true
python3 .gpu/model_shapes.py qwen3-8b /tmp/shapes/qwen3-8b --tokenizer .gpu/smollm2 >/dev/null
for q in none fp8; do
  timeout 55 python3 -m bench.engine.throughput --model /tmp/shapes/qwen3-8b --device cuda --prompt-len 512 --new-tokens 64 \
    --batch-sizes 1 64 --runs 2 --no-reference $([ $q = fp8 ] && echo --quantization fp8) \
    --json "$OUT/qwen3-8b-w$q.json" 2>&1 | grep -v -i warn | tail -3 || true
done
for kv in auto fp8; do
  timeout 65 python3 -m bench.engine.throughput --model /tmp/shapes/qwen3-8b --device cuda --prompt-len 2048 --new-tokens 32 \
    --batch-sizes 256 --runs 1 --no-reference --max-num-batched-tokens 16384 --kv-cache-dtype $kv \
    --json "$OUT/qwen3-8b-kv$kv.json" 2>&1 | grep -v -i warn | tail -3 || true
done

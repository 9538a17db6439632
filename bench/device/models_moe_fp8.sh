# GPU run (issue: the engine runs the models people serve), second part: MoE shapes (random weights drawn on the
# device, --load-format dummy: qwen3-30b-a3b's 61 GB and mixtral-8x7b's 93 GB do not fit its 64 GB disk) against
# transformers eager built from the same config; FP8 weights and FP8 KV on qwen3-8b (files written on the device).
# `bash bench/device/models_moe_fp8.sh`; carries .whl and .gpu (setup.sh).
source bench/device/setup.sh
ENGINE_TEST_DEVICE=cuda timeout 45 python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_kernels.py -k "fp8" 2>&1 | tee "$OUT/cuda-tests-fp8.txt" | tail -3 || true
python3 bench/device/shape_config.py qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b
timeout 140 python3 -m bench.engine.throughput --model /tmp/shapes/qwen3-30b-a3b --load-format dummy --device cuda \
  --prompt-len 512 --new-tokens 32 --batch-sizes 1 64 --runs 2 --json "$OUT/qwen3-30b-a3b-512.json" 2>&1 \
  | grep -v -i warn | tail -6 || true
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
rm -rf /tmp/shapes/qwen3-8b
python3 bench/device/shape_config.py mixtral-8x7b /tmp/shapes/mixtral-8x7b
timeout 80 python3 -m bench.engine.throughput --model /tmp/shapes/mixtral-8x7b --load-format dummy --device cuda \
  --prompt-len 512 --new-tokens 32 --batch-sizes 1 64 --runs 1 --no-reference \
  --json "$OUT/mixtral-8x7b-512.json" 2>&1 | grep -v -i warn | tail -4 || true

# GPU run (issue #29): the one-token FP8 kernel's tiles swept wider (bench/device/gemv_swap.py --token-tiles), then
# bench.engine.throughput on qwen3-8b with those tiles, bf16 against FP8 weights at batch 1.
# `bash bench/device/fp8_token_tiles_round.sh`; carries .whl and .gpu. About 5 minutes.
source bench/device/setup.sh
timeout 200 python3 bench/device/gemv_swap.py --token-tiles "$OUT/token-tiles.json" --seconds ${SWEEP_S:-150} \
  --json "$OUT/token-sweep.json" 2>&1 | grep -v -i warn || true
cat "$OUT/token-tiles.json" || true
python3 .gpu/model_shapes.py qwen3-8b /tmp/shapes/qwen3-8b --tokenizer .gpu/smollm2 >/dev/null
for q in none fp8; do
  ENGINE_GEMV_TILES="$OUT/token-tiles.json" timeout 80 python3 -m bench.engine.throughput --model /tmp/shapes/qwen3-8b \
    --device cuda --prompt-len 512 --new-tokens 64 --batch-sizes 1 --runs 2 --no-reference \
    $([ $q = fp8 ] && echo --quantization fp8) --json "$OUT/qwen3-8b-w$q-token-tiles.json" 2>&1 | grep -v -i warn | tail -2 || true
done

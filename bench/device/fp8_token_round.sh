# GPU run (issue #29, FP8 weights at batch 1): the one-token CUDA-core FP8 kernel (engine/kernels/gemv.py) in the
# engine: its CUDA tests, then bench.engine.throughput on qwen3-8b, bf16 against FP8 weights at batch 1 and 64.
# `bash bench/device/fp8_token_round.sh`; carries .whl and .gpu (setup.sh). About 4 minutes.
source bench/device/setup.sh
ENGINE_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider tests/engine/test_kernels.py \
  -k "skinny or one_token" 2>&1 | tail -3 || true
python3 .gpu/model_shapes.py qwen3-8b /tmp/shapes/qwen3-8b --tokenizer .gpu/smollm2 >/dev/null
for q in ${QUANTS:-none fp8}; do
  timeout 100 python3 -m bench.engine.throughput --model /tmp/shapes/qwen3-8b --device cuda --prompt-len 512 \
    --new-tokens 64 --batch-sizes 1 64 --runs 2 --no-reference $([ $q = fp8 ] && echo --quantization fp8) \
    --json "$OUT/qwen3-8b-w$q-token.json" 2>&1 | grep -v -i warn | tail -3 || true
done

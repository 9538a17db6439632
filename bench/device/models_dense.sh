# GPU run (issue: the engine runs the models people serve): the model-family tests on CUDA, then bench.engine.throughput
# against transformers eager on the dense 8B shapes (random bf16 weights in the Hub layout, written on the device
# by model_shapes.py and loaded from those safetensors files), prompt 512 (batch 1 and 64) and 4,096 (batch 1).
# `bash bench/device/models_dense.sh [SHAPE...]` (default: qwen3-8b llama31-8b); carries .whl and .gpu (setup.sh).
source bench/device/setup.sh
SHAPES=${*:-qwen3-8b llama31-8b}
python3 -c 'import torch; x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); import time
for _ in range(3): x @ x
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(10): x @ x
torch.cuda.synchronize(); print("bf16 matmul peak TFLOP/s", round(10 * 2 * 8192**3 / (time.perf_counter() - t) / 1e12))' \
  | tee "$OUT/matmul-peak.txt"
ENGINE_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_model_families.py \
  tests/engine/test_moe.py tests/engine/test_kernels.py -k "family or moe or Moe" 2>&1 | tee "$OUT/cuda-tests-models.txt" | tail -5 || true
for shape in $SHAPES; do
  dir=/tmp/shapes/$shape
  start=$(date +%s)
  python3 .gpu/model_shapes.py "$shape" "$dir" --tokenizer .gpu/smollm2 >/dev/null
  echo "$shape: weights written in $(( $(date +%s) - start )) s ($(du -sh "$dir" | cut -f1))"
  timeout 300 python3 -m bench.engine.throughput --model "$dir" --device cuda --prompt-len 512 --new-tokens 64 \
    --batch-sizes 1 64 --runs 2 --json "$OUT/$shape-512.json" 2>&1 | grep -v -i warn | tail -8 || true
  timeout 200 python3 -m bench.engine.throughput --model "$dir" --device cuda --prompt-len 4096 --new-tokens 16 \
    --batch-sizes 1 --runs 2 --json "$OUT/$shape-4096.json" 2>&1 | grep -v -i warn | tail -4 || true
  rm -rf "$dir"
done

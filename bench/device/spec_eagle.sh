# GPU run (issue #35: EAGLE-3 speculative decoding): the EAGLE-3 tests on CUDA, then what EAGLE-3 steps cost against
# plain decode steps on the Llama-3.1-8B shape (random bf16 target weights in the Hub layout, written by
# model_shapes.py; a random head of the published EAGLE3-LLaMA3.1-Instruct-8B shape: hidden 4096, one layer, draft
# vocabulary 32,000), context 512, batch 1, 8 and 32, k = 1..5: the ratio of step times is the acceptance length a
# trained head must reach to gain (a random head's drafts are noise: about one token per step). Then the verify-only
# cost (forced drafts, no head) for the same shape. `bash bench/device/spec_eagle.sh [SHAPE]` (default:
# llama31-8b); carries .whl and .gpu (setup.sh). Not run yet: written without device time.
source bench/device/setup.sh
SHAPE=${1:-llama31-8b}
ENGINE_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -p no:cacheprovider tests/engine/test_spec_eagle3.py \
  tests/engine/test_spec_decode_kernels.py 2>&1 | tee "$OUT/cuda-tests-eagle3.txt" | tail -5 || true
dir=/tmp/shapes/$SHAPE
python3 .gpu/model_shapes.py "$SHAPE" "$dir" --tokenizer .gpu/smollm2 >/dev/null
# Engines are built one after another in one process: each takes under half the GPU, so a freed one never blocks.
timeout 420 python3 -m bench.engine.spec --eagle random --model "$dir" --device cuda --prompt-len 512 --max-k 5 \
  --batch-sizes 1 8 32 --steps 20 --gpu-memory-utilization 0.45 --json "$OUT/spec-eagle3-$SHAPE.json" 2>&1 \
  | grep -v -i warn | tail -24 || true
timeout 240 python3 -m bench.engine.spec --verify-cost --model "$dir" --device cuda --prompt-len 512 --max-k 5 \
  --batch-sizes 1 8 32 --steps 30 --json "$OUT/spec-verify-$SHAPE.json" 2>&1 | grep -v -i warn | tail -20 || true
rm -rf "$dir"

# GPU run (issue #35: speculative decoding with CUDA graphs on):
# 1. tests: the speculative-decoding tests on CUDA, among them greedy equality with the graphs captured and
#    replayed for n-gram verify rows and for EAGLE-3 steps (tests/engine/test_spec_decode_kernels.py: random head,
#    and a head forced to the target's continuation so that drafts stand and roll back through the graphs);
# 2. verify: what a verify step (k = 1..5 forced drafts a row, no head) costs against a plain decode step on the
#    Llama-3.1-8B shape (random bf16 target weights in the Hub layout, written by model_shapes.py), context 512,
#    batch 1, 8 and 32, graphs on: the ratio is the acceptance length k drafts must reach to gain;
# 3. eagle: the same for whole EAGLE-3 steps (the head's k - 1 passes + the verify + its catch-up) with a random
#    head of the published EAGLE3-LLaMA3.1-Instruct-8B shape (hidden 4096, one layer, draft vocabulary 32,000).
# Every figure says which kind of step it timed (DecodeGraphStep / MixedGraphStep: a graph replay; EagerStep).
# `bash bench/device/spec_eagle.sh [SHAPE] [STAGES]` (default: llama31-8b "tests verify eagle"; each stage fits a
# 10-minute call alone, all three may not); carries .whl and .gpu (setup.sh). Not run yet: written without
# device time.
source bench/device/setup.sh
SHAPE=${1:-llama31-8b}
STAGES=${2:-tests verify eagle}
dir=/tmp/shapes/$SHAPE
if [[ " $STAGES " == *" tests "* ]]; then
  ENGINE_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -p no:cacheprovider tests/engine/test_spec_decode_kernels.py \
    tests/engine/test_spec_eagle3.py 2>&1 | tee "$OUT/cuda-tests-spec-graphs.txt" | tail -8 || true
fi
if [[ " $STAGES " == *" verify "* || " $STAGES " == *" eagle "* ]]; then
  python3 .gpu/model_shapes.py "$SHAPE" "$dir" --tokenizer .gpu/smollm2 >/dev/null
fi
if [[ " $STAGES " == *" verify "* ]]; then
  timeout 240 python3 -m bench.engine.spec --verify-cost --model "$dir" --device cuda --prompt-len 512 --max-k 5 \
    --batch-sizes 1 8 32 --steps 30 --json "$OUT/spec-verify-graphs-$SHAPE.json" 2>&1 | grep -v -i warn | tail -20 || true
fi
if [[ " $STAGES " == *" eagle "* ]]; then
  # Engines are built one after another in one process: each takes under half the GPU, so a freed one never blocks.
  timeout 420 python3 -m bench.engine.spec --eagle random --model "$dir" --device cuda --prompt-len 512 --max-k 5 \
    --batch-sizes 1 8 32 --steps 20 --gpu-memory-utilization 0.45 --json "$OUT/spec-eagle3-$SHAPE.json" 2>&1 \
    | grep -v -i warn | tail -24 || true
fi
rm -rf "$dir"

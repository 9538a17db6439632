# GPU run (issue #35: speculative decoding): the speculative-decoding tests on CUDA, then what a verify step
# (k = 1..5 drafts per row) costs against a plain decode step on the dense 8B shape (random bf16 weights in the
# Hub layout, written by model_shapes.py), context 512, batch 1, 8 and 32: the ratio is the acceptance length
# k drafts must reach to gain. `bash bench/device/spec_verify.sh [SHAPE]` (default: qwen3-8b); carries .whl and
# .gpu (setup.sh). Not run yet: written when the session's device time was spent.
source bench/device/setup.sh
SHAPE=${1:-qwen3-8b}
ENGINE_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -p no:cacheprovider tests/engine/test_spec_decode.py \
  tests/engine/test_spec_decode_kernels.py 2>&1 | tee "$OUT/cuda-tests-spec.txt" | tail -5 || true
dir=/tmp/shapes/$SHAPE
python3 .gpu/model_shapes.py "$SHAPE" "$dir" --tokenizer .gpu/smollm2 >/dev/null
for eager in "" "--enforce-eager"; do
  timeout 240 python3 -m bench.engine.spec --verify-cost --model "$dir" --device cuda --prompt-len 512 --max-k 5 \
    --batch-sizes 1 8 32 --steps 30 $eager --json "$OUT/spec-verify-$SHAPE${eager:+-eager}.json" 2>&1 \
    | grep -v -i warn | tail -20 || true
done
rm -rf "$dir"

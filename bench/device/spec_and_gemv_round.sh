# GPU run of 2026-12-02 (issues #35 and #29): the speculative-decoding CUDA tests with graphs, the verify step's cost
# on llama31-8b at batch 1 and 8, and the FP8 skinny-matmul candidates. `bash bench/device/spec_and_gemv_round.sh`.
set +e
SHAPE=llama31-8b
bash bench/device/spec_eagle.sh $SHAPE "tests" 2>&1 | tail -12
source bench/device/setup.sh >/dev/null 2>&1
set +e  # setup.sh sets -e: one failing step must not end the call
python3 .gpu/model_shapes.py $SHAPE /tmp/shapes/$SHAPE --tokenizer .gpu/smollm2 >/dev/null
timeout 170 python3 -m bench.engine.spec --verify-cost --model /tmp/shapes/$SHAPE --device cuda --prompt-len 512 --max-k 5 \
  --batch-sizes 1 8 --steps 20 --json "$OUT/spec-verify-graphs-$SHAPE.json" 2>&1 | grep -v -i warn | tail -16
timeout 100 python3 bench/device/gemv_variants.py --seconds 75 --json "$OUT/gemv-variants.json" 2>&1 | grep -v -i warn | tail -8

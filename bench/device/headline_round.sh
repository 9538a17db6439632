# GPU run (issue #29): the headline figures of docs/results/engine-models-cuda.json on the current engine, against
# transformers eager in the same call: qwen3-8b and qwen3-30b-a3b (random weights, --load-format dummy; transformers
# its own random init of the same config, drawn on the GPU), prompt 512, batch 1 and 64, median of 2 runs.
# `bash bench/device/headline_round.sh` (SHAPES, NEW_TOKENS, SHAPE_S: a run's seconds); carries .whl and .gpu. About
# 5 minutes. JSON and logs under $OUT.
source bench/device/setup.sh
for shape in ${SHAPES:-qwen3-8b qwen3-30b-a3b}; do
  python3 bench/device/shape_config.py $shape /tmp/shapes/$shape
  timeout "${SHAPE_S:-170}" python3 -m bench.engine.throughput --model /tmp/shapes/$shape --load-format dummy \
    --device cuda --prompt-len 512 --new-tokens "${NEW_TOKENS:-64}" --batch-sizes 1 64 --runs 2 \
    --json "$OUT/$shape-512.json" 2>&1 | grep -v -i warn | tee "$OUT/$shape-512.log" | grep -E "^ +[0-9]+ \||built" || true
done
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)

# GPU run (issue #29): --async-scheduling with temperature sampling (0.8, top-p 0.95) instead of greedy, off and on
# alternating on one engine (bench.engine.throughput --async-ab): SmolLM2's shape at batch 1, 16, 64 and 256 and
# qwen3-8b (random weights, --load-format dummy) at batch 1 and 64, prompt 512.
# `bash bench/device/async_sampling_round.sh`; carries .whl and .gpu. About 4 minutes. JSON and logs under $OUT.
source bench/device/setup.sh
ENGINE_S=${ENGINE_S:-110} engine_bench smollm2-async-sampled "$MODEL" --prompt-len 512 --new-tokens 128 \
  --batch-sizes 1 16 64 256 --async-ab --runs 3 --temperature 0.8 --top-p 0.95
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b
ENGINE_S=${ENGINE_S:-130} engine_bench qwen3-8b-async-sampled /tmp/shapes/qwen3-8b --prompt-len 512 --new-tokens 64 \
  --batch-sizes 1 64 --async-ab --runs 3 --temperature 0.8 --top-p 0.95
grep -h "async scheduling" "$OUT"/*.log || true
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)

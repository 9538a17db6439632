# GPU run (issue #29): --async-scheduling, a decode step scheduled and launched while the one before runs (its input
# ids read on the device). 1. the CUDA tests of it, and the graph-replay and sampler tests of the kernels; 2. decode
# tok/s with it off and on, alternating on one engine (bench.engine.throughput --async-ab), on qwen3-8b (random
# weights, --load-format dummy) at batch 1 and 64, prompt 512, and on SmolLM2's shape at batch 1, 16, 64 and 256;
# 3. the batch-64 qwen3-8b step profiled (its host part, one step at a time).
# `bash bench/device/async_round.sh`; carries .whl and .gpu. About 6 minutes. JSON and logs under $OUT.
source bench/device/setup.sh
ENGINE_TEST_DEVICE=cuda timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_async_scheduling.py tests/engine/test_kernels.py \
  -k "async or ahead or abort or graph_replay or sampler_features or generates_what" 2>&1 \
  | tee "$OUT/cuda-tests-async.txt" | tail -4 || true
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b
ENGINE_S=${ENGINE_S:-170} engine_bench qwen3-8b-async /tmp/shapes/qwen3-8b --prompt-len 512 --new-tokens 64 \
  --batch-sizes 1 64 --async-ab --runs 3 --profile --profile-batch 64
ENGINE_S=${ENGINE_S:-120} engine_bench smollm2-async "$MODEL" --prompt-len 512 --new-tokens 128 \
  --batch-sizes 1 16 64 256 --async-ab --runs 3
grep -h "async scheduling" "$OUT"/*.log || true
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)

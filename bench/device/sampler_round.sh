# GPU run (issue #29): the sampler's top-p cut without a sort. Its CUDA test (the cut against the sorted rule),
# bench.engine.sampler_speed (the draw of one step, cut against sorted, same process), then sampled decode
# (temperature 0.8, top-p 0.95) with --async-scheduling off and on: qwen3-8b (random weights) at 64, prompt 512
# (SMOLLM2=1: SmolLM2's shape at 64 and 256 too). `bash bench/device/sampler_round.sh`; carries .whl and .gpu. About 3 minutes.
source bench/device/setup.sh
ENGINE_TEST_DEVICE=cuda ENGINE_TEST_DTYPE=bfloat16 timeout 100 python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_kernels.py -k "top_p_cut" 2>&1 | tee "$OUT/cuda-tests-sampler.txt" | tail -2 || true
timeout 60 python3 -m bench.engine.sampler_speed --batches 1 64 256 --json "$OUT/sampler-speed.json" 2>&1 \
  | grep -v -i warn || true
[ -n "${SMOLLM2:-}" ] && ENGINE_S=${ENGINE_S:-60} engine_bench smollm2-sampled-cut "$MODEL" --prompt-len 512 \
  --new-tokens 128 --batch-sizes 64 256 --async-ab --runs 3 --temperature 0.8 --top-p 0.95 >/dev/null || true
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b
ENGINE_S=${ENGINE_S:-90} engine_bench qwen3-8b-sampled-cut /tmp/shapes/qwen3-8b --prompt-len 512 --new-tokens 64 \
  --batch-sizes 64 --async-ab --runs 3 --temperature 0.8 --top-p 0.95 >/dev/null || true
grep -h "async scheduling" "$OUT"/*.log || true
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)

# GPU run (issue #29): the sampler's top-p cut without a sort. Its CUDA tests (the cut against the sorted rows, the
# seeded-draw and async-scheduling tests), bench.engine.sampler_speed (the draw of one step, cut against sorted, same
# process), then sampled decode (temperature 0.8, top-p 0.95) with --async-scheduling off and on: SmolLM2's shape at
# batch 1, 16, 64, 256 and qwen3-8b (random weights) at 1 and 64, prompt 512.
# `bash bench/device/sampler_round.sh`; carries .whl and .gpu. About 5 minutes. JSON and logs under $OUT.
source bench/device/setup.sh
ENGINE_TEST_DEVICE=cuda ENGINE_TEST_DTYPE=bfloat16 timeout 150 python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_kernels.py tests/engine/test_async_scheduling.py -k "top_p_cut or sampler or seeded or ahead" \
  2>&1 | tee "$OUT/cuda-tests-sampler.txt" | tail -4 || true
timeout 120 python3 -m bench.engine.sampler_speed --json "$OUT/sampler-speed.json" 2>&1 | grep -v -i warn || true
timeout 60 python3 -m bench.engine.sampler_speed --vocab 49152 --json "$OUT/sampler-speed-smollm2.json" 2>&1 \
  | grep -v -i warn || true
source bench/device/async_sampling_round.sh

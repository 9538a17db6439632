# GPU run (issue #29), after pdl_final_round.sh: an FP8 SwiGLU projection at one token now lets the next kernel launch
# after its loop (it launched plainly). The FP8 CUDA tests, then bench.engine.throughput on qwen3-8b (random
# weights, --load-format dummy): FP8 weights at batch 1 with PDL on / off, bf16 at batch 64 with PDL on.
# `bash bench/device/pdl_fp8_round.sh`; carries .whl and .gpu. About 4 minutes.
source bench/device/setup.sh
ENGINE_TEST_DEVICE=cuda ENGINE_TEST_DTYPE=bfloat16 timeout 100 python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_fp8.py 2>&1 | tee "$OUT/cuda-tests-pdl-fp8.txt" | tail -2 || true
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b
for run in "b1-fp8-on||--batch-sizes 1 --quantization fp8" "b1-fp8-off|0|--batch-sizes 1 --quantization fp8" \
           "b64-on||--batch-sizes 64"; do
  IFS='|' read -r name pdl args <<< "$run"
  ENGINE_PDL=$pdl ENGINE_S=80 engine_bench qwen3-8b-$name /tmp/shapes/qwen3-8b --prompt-len 512 --new-tokens 64 \
    --runs 3 $args | grep -E "engine batch" || true
done
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)

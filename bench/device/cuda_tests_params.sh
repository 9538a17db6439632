# GPU run after the engine's OpenAI parameters (sampler, grammars, tools, logprobs, n): the CUDA tests of
# the parameters, the kernels (sampler features through the graphs), the core and P/D, then a short decode
# benchmark against the earlier figures. `bash bench/device/cuda_tests_params.sh`; writes under $OUT.
source bench/device/setup.sh
mkdir -p /tmp/ibv && for f in .deb/*.deb; do dpkg -x "$f" /tmp/ibv; done
export LD_LIBRARY_PATH=/tmp/ibv/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
ENGINE_TEST_DEVICE=cuda timeout 330 python3 -m pytest -q -rs -p no:cacheprovider tests/engine/test_openai_params.py \
  tests/engine/test_kernels.py tests/engine/test_engine_core.py tests/test_pd_engine.py 2>&1 \
  | tee "$OUT/cuda-tests-params.txt" | tail -25 || true
timeout 150 python3 -m bench.engine.throughput --model "$MODEL" --device cuda --prompt-len 512 --new-tokens 128 \
  --batch-sizes 1 64 --runs 3 --no-reference --json "$OUT/engine-bench-cuda-params.json" 2>&1 \
  | grep -v -i warn | tee "$OUT/engine-bench-cuda-params.txt" | tail -6 || true

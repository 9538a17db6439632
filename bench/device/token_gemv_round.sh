# GPU run (issue #29, batch-1 targets): one token's linear layers in CUDA C++ (engine/kernels/token_gemv.cu) against
# the Triton kernels. 1. the CUDA tests of the skinny matmuls; 2. each projection alone and the 36-layer chain
# (bench/device/token_gemv_bench.py); 3. qwen3-8b at batch 1, bf16 and FP8 weights, each on either kernel
# (ENGINE_TOKEN_GEMV), in its own process. `bash bench/device/token_gemv_round.sh`; carries .whl and .gpu.
source bench/device/setup.sh
[ -n "${SKIP_TESTS:-}" ] || ENGINE_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_kernels.py -k "(cuda_matmul or takes_what_it_divides or token or skinny or gemv) and not sampler" \
  2>&1 | tail -4 | tee "$OUT/cuda-tests.txt" || true
[ -n "${NO_BENCH:-}" ] || timeout 200 python3 bench/device/token_gemv_bench.py --json "$OUT/token-gemv.json" 2>&1 | grep -v -i warn | cut -c1-330
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b >/dev/null
for q in none fp8; do
  for m in cuda triton; do
    extra=(); [ $q = fp8 ] && extra=(--quantization fp8)
    ENGINE_TOKEN_GEMV=$m ENGINE_S=${ENGINE_S:-90} engine_bench qwen3-8b-b1-$q-$m /tmp/shapes/qwen3-8b --prompt-len 512 \
      --batch-sizes 1 --new-tokens 128 "${extra[@]}" | grep -E "^ +1 \|" | sed "s/^/$q $m /" || true
  done
done
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)

# GPU run (issue #29): FP8 x FP8 at small batches in the engine (gemv(..., w8a8=True): the o and down projections
# in parts, the fused gate/up; activations quantized per token and 128 columns in each program). CUDA tests of the
# skinny matmuls, PDL and FP8 models; w8a8_token.py (the engine's kernel beside activations quantized before it);
# then qwen3-8b at batch 1: FP8 with W8A8 (W8A8_MAX_TOKENS=16) against weight-only FP8 (=0), each its own process,
# alternating, and bf16 once. `bash bench/device/w8a8_engine_round.sh`; carries .whl. About 9 minutes.
source bench/device/setup.sh
set +e
ENGINE_TEST_DEVICE=cuda ENGINE_TEST_DTYPE=bfloat16 timeout ${TESTS_S:-80} python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_kernels.py tests/engine/test_pdl.py tests/engine/test_model_families.py \
  -k "w8a8 or skinny or one_token or pdl or wait or launch or fp8" \
  2>&1 | tee "$OUT/cuda-tests-w8a8.txt" | tail -3
timeout ${BENCH_S:-170} python3 bench/device/w8a8_token.py --json "$OUT/w8a8-engine-token.json" \
  --seconds ${SECONDS_W8A8:-130} --variants engine8,w8a8 2>&1 | grep -v -i warn | tee "$OUT/w8a8-engine-token.log" | grep -E "engine|chain"
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b
run() {  # name w8a8_max_tokens args...
  local name=$1 t=$2
  shift 2
  timeout ${ENGINE_S:-80} python3 bench/device/launch_ab.py engine.kernels.gemv.W8A8_MAX_TOKENS=$t -- \
    --model /tmp/shapes/qwen3-8b --load-format dummy --device cuda --no-reference --prompt-len 512 \
    --json "$OUT/$name.json" "$@" 2>&1 | grep -v -i warn > "$OUT/$name.log"
  grep -E "^ +[0-9]+ \||decode step" "$OUT/$name.log" | head -3
}
for t in 16 0 16; do
  run qwen3-8b-fp8-b1-w8a8max$t-$RANDOM $t --runs 3 --new-tokens 64 --batch-sizes 1 --quantization fp8
done
run qwen3-8b-bf16-b1 16 --runs 3 --new-tokens 64 --batch-sizes 1
decode_figures
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json ./*.txt && rm -f ./*.log ./*.json ./*.txt)

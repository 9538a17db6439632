# GPU run (issue #29): an FP8 MLP's down projection FP8 x FP8 in small steps, its activations quantized by the
# gate/up kernel's SwiGLU epilogue (gemv.swiglu_fp8 -> Fp8Rows -> the W8A8 kernel in parts). CUDA tests of the skinny
# matmuls, PDL and FP8 models; w8a8_token.py (the pair's kernels alone and as a 36-layer MLP chain); then qwen3-8b
# at batch 1: FP8 with W8A8 (W8A8_MAX_TOKENS=16) against weight-only FP8 (=0), each its own process, alternating,
# and bf16 once. `bash bench/device/w8a8_engine_round.sh`; carries .whl and .gpu. About 9 minutes.
source bench/device/setup.sh
set +e
ENGINE_TEST_DEVICE=cuda ENGINE_TEST_DTYPE=bfloat16 timeout ${TESTS_S:-70} python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_kernels.py tests/engine/test_pdl.py tests/engine/test_model_families.py \
  -k "w8a8 or fp8_mlp or swiglu or skinny or one_token or pdl or wait or launch or fp8" \
  2>&1 | tee "$OUT/cuda-tests-w8a8.txt" | tail -3
timeout ${BENCH_S:-170} python3 bench/device/w8a8_token.py --json "$OUT/w8a8-engine-token.json" \
  --seconds ${SECONDS_W8A8:-110} 2>&1 | grep -v -i warn | tee "$OUT/w8a8-engine-token.log" | grep -E "chain|gate_up|down"
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

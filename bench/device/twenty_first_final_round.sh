# GPU run (issue #29), the twenty-first round's final defaults (the rope in the attention launch, the attention early,
# a run of every 16-bit row staged before the wait, a MoE router's norm folded): batch 1 on qwen3-8b bf16 and FP8
# weights, qwen3-30b-a3b and SmolLM2's shape, each in its own process; then the CUDA tests of the kernels, the model
# families in bf16 and the MoE's one-token kernels on these defaults. `bash bench/device/twenty_first_final_round.sh`;
# carries .whl, .gpu.
source bench/device/setup.sh
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b >/dev/null
python3 bench/device/shape_config.py qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b >/dev/null
B1=(--batch-sizes 1 --new-tokens 128)
K=engine.kernels.token_gemv
for shape in qwen3-8b qwen3-8b-fp8 qwen3-30b-a3b smollm2; do
  case $shape in
    qwen3-8b-fp8) dir=/tmp/shapes/qwen3-8b; extra=(--quantization fp8) ;;
    smollm2) dir=$MODEL; extra=() ;;
    *) dir=/tmp/shapes/$shape; extra=() ;;
  esac
  ab_bench "final-$shape" "$dir" $K.PIN_LOADS=1 -- "${B1[@]}" "${extra[@]}" | grep -E "^ +1 \|" | sed "s/^/$shape /" || true
done
cuda_tests "token or norm or graph_replay or bfloat16 or rope or staged or router or one_token" \
  tests/engine/test_kernels.py tests/engine/test_model_families.py tests/engine/test_moe.py
(cd "$OUT" && tar rf runs.tar ./*.log ./*.json && rm -f ./*.log ./*.json) 2>/dev/null || true

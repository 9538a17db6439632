# GPU run (issue #29, batch-1 targets): where a batch-1 decode step's time goes under PDL, kernel by kernel, as each
# kernel's share of the GPU's timeline (what its end adds past the kernels before; bench.engine.throughput --profile),
# on qwen3-8b in bf16 and with FP8 weights, and qwen3-30b-a3b (random weights, prompt 512).
# `bash bench/device/timeline_round.sh`; carries .whl and .gpu (setup.sh). SHAPES picks the runs.
source bench/device/setup.sh
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b >/dev/null
python3 bench/device/shape_config.py qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b >/dev/null
for run in ${SHAPES:-qwen3-8b qwen3-8b-fp8 qwen3-30b-a3b}; do
  args=()
  [ "$run" != qwen3-8b-fp8 ] || args=(--quantization fp8)
  ENGINE_S=120 engine_bench "$run-timeline" "/tmp/shapes/${run%-fp8}" --batch-sizes 1 --new-tokens 64 --profile \
    "${args[@]}" >/dev/null
  sed -n '/critical path/,/^[^ ]/p' "$OUT/$run-timeline.log" | head -30 | sed "s/^/$run /"
  grep -E "^ +1 \||decode step" "$OUT/$run-timeline.log" | sed "s/^/$run /"
done
(cd "$OUT" && tar rf runs.tar ./*.log ./*.json && rm -f ./*.log ./*.json) 2>/dev/null || true

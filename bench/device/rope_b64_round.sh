# GPU run (issue #29): the rope in the attention launch (triton_ops.ROPE_IN_ATTENTION, on since the twenty-first
# round's batch-1 figures) at batch 64 on qwen3-8b, against the rope kernel; prompt 512, 64 new tokens, each in its own
# process. `bash bench/device/rope_b64_round.sh`; carries .whl, .gpu.
source bench/device/setup.sh
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b >/dev/null
for rope in 0 1; do
  ENGINE_S=100 ab_bench "qwen3-8b-b64-rope$rope" /tmp/shapes/qwen3-8b engine.kernels.triton_ops.ROPE_IN_ATTENTION=$rope \
    -- --batch-sizes 64 --new-tokens 64 | grep -E "^ +64 \|" | sed "s/^/rope $rope /" || true
done
(cd "$OUT" && tar rf runs.tar ./*.log ./*.json && rm -f ./*.log ./*.json) 2>/dev/null || true

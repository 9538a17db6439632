# qwen3-8b (random weights) with 2,048-token prompts at batch 256, a bf16 KV cache against an FP8 one, in the engine;
# prints FP8 over bf16 (issue #29's target: 1.3x). Sourced by the round scripts after setup.sh.
# MEASURE=step (default): the GPU time of a decode step of 256 sequences (--profile --profile-batch 256, CUDA events);
# MEASURE=throughput: decode tok/s of the batch-256 run, the earlier rounds' figure, which also counts tokens decoded
# while later prompts are still in chunked prefill. Files: $OUT/qwen3-8b-kv{auto,fp8}.{json,log}.
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b
if [ "${MEASURE:-step}" = step ]; then measure=(--new-tokens 8 --profile --profile-batch 256); else measure=(--new-tokens 32); fi
for kv in auto fp8; do
  engine_bench qwen3-8b-kv$kv /tmp/shapes/qwen3-8b --prompt-len 2048 --batch-sizes 256 --max-num-batched-tokens 16384 \
    --kv-cache-dtype $kv "${measure[@]}"
done
python3 - "$OUT" "${MEASURE:-step}" <<'PY'
import json, sys
out, measure = sys.argv[1:]
speed, wall = {}, {}  # higher is faster; wall: the step with the host's part (scheduling, staging, bookkeeping)
for kv in ("auto", "fp8"):
    try:
        with open(f"{out}/qwen3-8b-kv{kv}.json") as f:
            run = json.load(f)
        if measure == "step":
            prof = run["step_profile_us"]
            speed[kv] = 256e6 / prof["execute_gpu_us"]
            wall[kv] = 256e6 / (prof["schedule_and_stage_us"] + prof["execute_us"] + prof["postprocess_us"])
            print(f"qwen3-8b kv {kv}: step " + ", ".join(f"{k} {v:.0f}" for k, v in prof.items() if k != "kernels_us"))
        else:
            speed[kv] = run["batches"]["256"]["engine"]["decode_tok_s"]
    except (OSError, KeyError, TypeError) as e:
        print("qwen3-8b", kv, "missing:", e)
if len(speed) == 2:
    what = "a decode step of 256 sequences at 2K context" if measure == "step" else "batch 256, 2K prompts"
    print(f"qwen3-8b, {what}: decode {speed['fp8']:.0f} tok/s with FP8 KV against {speed['auto']:.0f} with bf16 KV, "
          f"{speed['fp8'] / speed['auto']:.2f}x (target 1.3x)")
if len(wall) == 2:
    print(f"  the same with the host's part of each step: {wall['fp8']:.0f} against {wall['auto']:.0f} tok/s, "
          f"{wall['fp8'] / wall['auto']:.2f}x")
PY

# GPU run (issue #29): the engine with the decode-attention rule measured by attn_splits_round.sh (splits that fill
# one wave: engine.kernels.decode_splits; tiles: triton_ops.decode_tile). qwen3-8b (random weights, --load-format
# dummy): the GPU time of one decode step of 256 sequences at 2K context (--profile --profile-batch 256), bf16
# against FP8 KV; then prompt 512 at batch 1 and 64 (bf16). `bash bench/device/attn_engine_round.sh`; carries .whl
# and .gpu. About 5 minutes (SKIP_B64=1: the batch-256 pair alone). JSON and logs under $OUT.
source bench/device/setup.sh
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b
bench() {  # name, then bench.engine.throughput's arguments
  local name=$1; shift
  timeout ${ENGINE_S:-110} python3 -m bench.engine.throughput --model /tmp/shapes/qwen3-8b --load-format dummy \
    --device cuda --runs 1 --no-reference --json "$OUT/$name.json" "$@" 2>&1 | grep -v -i warn \
    | tee "$OUT/$name.log" | grep -E "^ +[0-9]+ \||engine batch|decode step|^ +[0-9.]+  _" | head -14 || true
}
for kv in auto fp8; do
  bench qwen3-8b-b256-kv$kv --prompt-len 2048 --new-tokens 8 --batch-sizes 256 --max-num-batched-tokens 16384 \
    --kv-cache-dtype $kv --profile --profile-batch 256
done
[ -n "${SKIP_B64:-}" ] || bench qwen3-8b-b1-b64 --prompt-len 512 --new-tokens 32 --batch-sizes 1 64
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
gpu = {}
for kv in ("auto", "fp8"):
    try:
        with open(f"{out}/qwen3-8b-b256-kv{kv}.json") as f:
            gpu[kv] = json.load(f)["step_profile_us"]["execute_gpu_us"]
    except (OSError, KeyError, TypeError) as e:
        print("qwen3-8b", kv, "missing:", e)
if len(gpu) == 2:
    print(f"qwen3-8b, a decode step of 256 sequences at 2K context: {gpu['fp8']:.0f} us of GPU time with FP8 KV against "
          f"{gpu['auto']:.0f} with bf16 KV: {gpu['auto'] / gpu['fp8']:.2f}x decode speed (target 1.3x)")
PY

# GPU run (issue #29) after --async-scheduling (on): qwen3-8b (random weights, --load-format dummy) decode at batch 1,
# bf16 against FP8 weights (target 1.6x), then batch 256 at 2K context with a bf16 against an FP8 KV cache, decode
# tok/s of the run (MEASURE=throughput; target 1.3x). `bash bench/device/fp8_async_round.sh`; carries .whl and .gpu.
# About 6 minutes. JSON and logs under $OUT.
source bench/device/setup.sh
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b
for q in bf16 fp8; do
  ENGINE_S=${ENGINE_S:-100} engine_bench qwen3-8b-b1-w$q-async /tmp/shapes/qwen3-8b --prompt-len 512 --new-tokens 64 \
    --batch-sizes 1 --runs 3 $([ $q = fp8 ] && echo --quantization fp8) | grep -E "engine batch" || true
done
python3 - "$OUT" <<'PY'
import json, sys
r = {q: json.load(open(f"{sys.argv[1]}/qwen3-8b-b1-w{q}-async.json"))["batches"]["1"]["engine"]["decode_tok_s"]
     for q in ("bf16", "fp8")}
print(f"batch 1: bf16 {r['bf16']:.1f} tok/s, fp8 {r['fp8']:.1f} tok/s: {r['fp8'] / r['bf16']:.3f}x")
PY
MEASURE=throughput ENGINE_S=${ENGINE_S:-150} source bench/device/kv_dtype_ab.sh
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)

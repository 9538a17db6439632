# GPU run (issue #29): FP8 weights widened by moving bits instead of Hopper's conversion instruction. The CUDA kernel
# tests of the skinny matmuls and the async-scheduling tests (ASYNC=1, about 80 s more), the one-token sweep and
# 36-layer chain of bench/device/fp8_widen.py, then bench.engine.throughput on qwen3-8b at batch 1: bf16, FP8 as
# before (ENGINE_FP8_WIDEN=cvt, packaged tiles) and FP8 widened by bits with the sweep's tiles.
# `bash bench/device/fp8_widen_round.sh`; carries .whl and .gpu (.deb for ASYNC=1). About 8 minutes.
source bench/device/setup.sh
ENGINE_TEST_DEVICE=cuda ENGINE_TEST_DTYPE=bfloat16 timeout 120 python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_kernels.py -k "skinny or one_token or widened" $([ -n "${ASYNC:-}" ] && echo \
  tests/engine/test_async_scheduling.py) 2>&1 | tee "$OUT/cuda-tests-widen.txt" | tail -6 || true
timeout $(( ${SWEEP_S:-150} + 90 )) python3 bench/device/fp8_widen.py --json "$OUT/fp8-widen.json" \
  --tiles "$OUT/widen-tiles.json" --seconds ${SWEEP_S:-150} 2>&1 | grep -v -i warn || true
cat "$OUT/widen-tiles.json" || true
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b
for q in bf16 fp8-cvt fp8-bits; do
  (
    [ $q = fp8-cvt ] && export ENGINE_FP8_WIDEN=cvt
    [ $q = fp8-bits ] && export ENGINE_GEMV_TILES=$OUT/widen-tiles.json
    ENGINE_S=${ENGINE_S:-90} engine_bench qwen3-8b-b1-$q-widen /tmp/shapes/qwen3-8b --prompt-len 512 --new-tokens 64 \
      --batch-sizes 1 --runs 3 $([ $q != bf16 ] && echo --quantization fp8) | grep -E "engine batch" || true
  )
done
python3 - "$OUT" <<'PY'
import json, sys
r = {}
for q in ("bf16", "fp8-cvt", "fp8-bits"):
    try:
        r[q] = json.load(open(f"{sys.argv[1]}/qwen3-8b-b1-{q}-widen.json"))["batches"]["1"]["engine"]["decode_tok_s"]
    except Exception as e:
        print(q, "no figure:", e)
print({q: round(v, 1) for q, v in r.items()}, {q: round(v / r["bf16"], 3) for q, v in r.items() if "bf16" in r})
PY
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)

# GPU run (issue #29): decode attention with each split sized from its sequence's own context, many small programs
# (engine.kernels.decode_splits, DECODE_PROGRAMS_PER_SM) and the measured decode tiles (triton_ops._decode_tile).
# 1. the CUDA kernel tests; 2. decode attention alone by split count (fp8_tune.py --only splits: batch 256 / 2K,
# 64 / 544, 16 / 8K, 1 / 4K; bf16 and FP8 caches; a few tiles each); 3. qwen3-8b (random weights, --load-format
# dummy) in the engine: prompt 512 at batch 1 and 64 (bf16), then batch 256 with 2,048-token prompts, bf16 against
# FP8 KV. `bash bench/device/attn_splits_round.sh`; carries .whl and .gpu. About 9 minutes. JSON and logs under $OUT.
source bench/device/setup.sh
ENGINE_TEST_DEVICE=cuda timeout ${TESTS_S:-100} python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_kernels.py -k "attention or fp8 or kernels_generates or cache or sized_from" 2>&1 \
  | tee "$OUT/cuda-tests-splits.txt" | tail -4 || true
timeout ${TUNE_S:-150} python3 bench/device/fp8_tune.py --only splits --seconds ${PART_S:-135} \
  --json "$OUT/attention-splits.json" 2>&1 | grep -v -i warn | tee "$OUT/attention-splits.log" || true
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b
bench() {  # name, then bench.engine.throughput's arguments
  local name=$1; shift
  timeout ${ENGINE_S:-80} python3 -m bench.engine.throughput --model /tmp/shapes/qwen3-8b --load-format dummy \
    --device cuda --new-tokens 32 --runs 1 --no-reference --json "$OUT/$name.json" "$@" 2>&1 \
    | grep -v -i warn | grep -E "^ +[0-9]+ \||engine batch" || true
}
bench qwen3-8b-b1-b64 --prompt-len 512 --batch-sizes 1 64
for kv in auto fp8; do
  bench qwen3-8b-kv$kv --prompt-len 2048 --batch-sizes 256 --max-num-batched-tokens 16384 --kv-cache-dtype $kv
done
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
runs = {}
for kv in ("auto", "fp8"):
    try:
        with open(f"{out}/qwen3-8b-kv{kv}.json") as f:
            runs[kv] = json.load(f)["batches"]["256"]["engine"]["decode_tok_s"]
    except (OSError, KeyError) as e:
        print("qwen3-8b", kv, "missing:", e)
if len(runs) == 2:
    print(f"qwen3-8b batch 256, 2K prompts: decode {runs['fp8']:.0f} tok/s FP8 KV against {runs['auto']:.0f} bf16 KV, "
          f"{runs['fp8'] / runs['auto']:.2f}x (target 1.3x)")
PY

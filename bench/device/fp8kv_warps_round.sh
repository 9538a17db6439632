# GPU run (issue #29): FP8-KV decode attention over smaller programs (1-2 warps: the probabilities stay in registers
# between the two dots, no barrier), bf16 over the same; then where a decode step's GPU time goes, kernel by kernel
# (bench.engine.throughput --profile), for qwen3-8b at batch 64 (bf16) and at batch 1 with FP8 weights.
# `bash bench/device/fp8kv_warps_round.sh`; carries .whl and .gpu (setup.sh). About 6 minutes. JSON and logs under $OUT.
source bench/device/setup.sh
timeout ${TUNE_S:-190} python3 bench/device/fp8_tune.py --only attention --layouts head --fp8-modes fp8 \
  --fp8-tiles ${FP8_TILES:-32:1:2,32:1:3,64:1:2,64:1:3,32:2:2,32:2:3,64:2:2,64:2:3,128:2:2,128:2:3,128:4:2,128:4:3} \
  --seconds ${PART_S:-170} --json "$OUT/attention-warps.json" 2>&1 | grep -v -i warn | tee "$OUT/attention-warps.log" \
  | grep -v "^attention [0-9]" || true
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b
run() {  # name, then bench.engine.throughput's arguments
  local name=$1; shift
  timeout ${BENCH_S:-100} python3 -m bench.engine.throughput --model /tmp/shapes/qwen3-8b --load-format dummy \
    --device cuda --prompt-len 512 --new-tokens 32 --runs 1 --no-reference --profile --json "$OUT/$name.json" "$@" \
    2>&1 | grep -v -i warn | tail -32 || true
}
run qwen3-8b-b64-profile --batch-sizes 64 --profile-batch 64
run qwen3-8b-fp8-b1-profile --batch-sizes 1 --quantization fp8

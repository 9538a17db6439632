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
engine_bench qwen3-8b-b64-profile /tmp/shapes/qwen3-8b --prompt-len 512 --new-tokens 32 --profile \
  --batch-sizes 64 --profile-batch 64
engine_bench qwen3-8b-fp8-b1-profile /tmp/shapes/qwen3-8b --prompt-len 512 --new-tokens 32 --profile \
  --batch-sizes 1 --quantization fp8

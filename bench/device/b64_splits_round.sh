# GPU run (issue #29, batch 64): a batch-64 decode step of qwen3-8b (random weights, --load-format dummy, prompt 512,
# bf16) with bf16 decode attention split to fill 8 programs an SM (the decode tile's programs_per_sm: 2 splits at
# 544 keys) against 4 (1 split), through ENGINE_DECODE_TILES, in one call; each run's step profiled (host and GPU
# time). `bash bench/device/b64_splits_round.sh`; carries .whl and .gpu. About 3 minutes. JSON under $OUT.
source bench/device/setup.sh
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b
for pps in 8 4; do
  ENGINE_DECODE_TILES="{\"bf16\": {\"programs_per_sm\": $pps}}" ENGINE_S=${ENGINE_S:-90} engine_bench \
    qwen3-8b-b64-pps$pps /tmp/shapes/qwen3-8b --prompt-len 512 --new-tokens 32 --batch-sizes 64 --profile \
    --profile-batch 64 | grep -E "engine batch|decode step|_paged|_merge" || true
done
rm -f "$OUT"/*.log

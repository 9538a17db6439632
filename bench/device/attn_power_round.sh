# GPU run (issue #29): decode attention between a batch-256 step's matmuls at the GPU's power cap
# (bench/device/attn_power.py), then the engine's step of 256 sequences at 2K context: bf16 KV, FP8 KV, and FP8 KV
# with the lazy rescale (ENGINE_DECODE_TILES). SM clock, power and throttle reasons logged every 100 ms (clocks.csv).
# `bash bench/device/attn_power_round.sh`; carries .whl and .gpu. About 7 minutes. JSON and logs under $OUT.
source bench/device/setup.sh
log_clocks 100
mark() { echo "$1 $(date +%T.%N | cut -c1-12)" >> "$OUT/marks.txt"; }
mark power
timeout 150 python3 bench/device/attn_power.py --json "$OUT/attn-power.json" 2>&1 | grep -v -i warn \
  | tee "$OUT/attn-power.log"
mark engine
ENGINE_S=${ENGINE_S:-110} source bench/device/kv_dtype_ab.sh
mark lazy
ENGINE_DECODE_TILES='{"fp8": {"lazy_rescale": true}}' ENGINE_S=${ENGINE_S:-110} engine_bench qwen3-8b-kvfp8-lazy \
  /tmp/shapes/qwen3-8b --prompt-len 2048 --batch-sizes 256 --max-num-batched-tokens 16384 --kv-cache-dtype fp8 \
  --new-tokens 8 --profile --profile-batch 256
mark end
kill $CLOCKS || true
(cd "$OUT" && tar czf logs.tgz ./*.log ./clocks.csv ./marks.txt && rm -f ./*.log ./clocks.csv ./marks.txt)
ls "$OUT"

# GPU run (issue #29): why FP8 decode attention is slower in the engine's batch-256 step than alone. 1. decode
# attention alone under each condition of the engine's step (bench/device/attn_gap.py); 2. the engine's step of 256
# sequences at 2K context, bf16 against FP8 KV (kv_dtype_ab.sh); 3. the FP8 step with masks on every tile
# (ENGINE_DECODE_TILES). The SM and memory clocks, power and throttle reasons are logged all along (clocks.csv).
# `bash bench/device/attn_gap_round.sh`; carries .whl and .gpu. About 8 minutes. JSON and logs under $OUT.
source bench/device/setup.sh
log_clocks 250
echo "attention alone $(date +%T)" >> "$OUT/marks.txt"
timeout 200 python3 bench/device/attn_gap.py --json "$OUT/attn-gap.json" 2>&1 | grep -v -i warn | tee "$OUT/attn-gap.log"
echo "engine $(date +%T)" >> "$OUT/marks.txt"
ENGINE_S=${ENGINE_S:-110} source bench/device/kv_dtype_ab.sh
echo "engine fp8 masked $(date +%T)" >> "$OUT/marks.txt"
ENGINE_DECODE_TILES='{"fp8": {"unmasked": false}}' ENGINE_S=${ENGINE_S:-110} engine_bench qwen3-8b-kvfp8-masked \
  /tmp/shapes/qwen3-8b --prompt-len 2048 --batch-sizes 256 --max-num-batched-tokens 16384 --kv-cache-dtype fp8 \
  --new-tokens 8 --profile --profile-batch 256
echo "end $(date +%T)" >> "$OUT/marks.txt"
kill $CLOCKS || true
python3 - "$OUT" <<'PY'
import csv, sys
rows = list(csv.reader(open(f"{sys.argv[1]}/clocks.csv")))[1:]
sm = [int(r[1].split()[0]) for r in rows if len(r) > 2 and r[1].strip()[0].isdigit()]
print("SM clock MHz: min", min(sm, default=0), "max", max(sm, default=0), "samples", len(sm))
PY
(cd "$OUT" && tar czf logs.tgz ./*.log ./clocks.csv ./marks.txt && rm -f ./*.log ./clocks.csv ./marks.txt)
ls "$OUT"

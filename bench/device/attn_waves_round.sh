# GPU run (issue #29): FP8 decode attention's programs at the power cap, by register cap and split count
# (bench/device/attn_power.py --variants): a 192-register program leaves 8 on an SM (two a scheduler), 168 registers
# ten (shared memory then bounds it), and the splits decide how whole the last wave is; VARIANTS (JSON, as
# attn_power.py's --variants) times others. Then, only if an FP8 variant beat the engine's tile in the synthetic step,
# the engine's step of 256 sequences at 2K context: bf16 KV, FP8 KV, and FP8 KV on that variant (through
# ENGINE_DECODE_TILES: its fields, and programs_per_sm chosen so decode_splits gives its split count).
# `bash bench/device/attn_waves_round.sh`; carries .whl and .gpu. About 8 minutes. JSON and logs under $OUT.
source bench/device/setup.sh
log_clocks 100
VARIANTS=${VARIANTS:-'{"fp8, 2 splits": [{}, 2], "fp8, 3 splits": [{}, 3], "fp8 168 regs": [{"max_registers": 168}, 1],
  "fp8 168 regs, 3 splits": [{"max_registers": 168}, 3], "fp8 168 regs, 5 splits": [{"max_registers": 168}, 5]}'}
timeout 200 python3 bench/device/attn_power.py --json "$OUT/attn-waves.json" --variants "$VARIANTS" 2>&1 | grep -v -i warn | tee "$OUT/attn-waves.log"
BEST=$(python3 - "$OUT/attn-waves.json" <<'PY'
import json, sys
runs = json.load(open(sys.argv[1]))["runs"]
name, r = min(((k, v) for k, v in runs.items() if k.startswith("fp8")), key=lambda kv: kv[1]["in_step_us"])
fields = dict(r["fields"])
if r["forced"]:
    fields["programs_per_sm"] = (r["splits"] * 2048 + 131) // 132
print("" if name == "fp8" else json.dumps({"fp8": fields}))
PY
)
echo "best in the synthetic step: ${BEST:-the engine tile}"
if [ -n "$BEST" ]; then
  ENGINE_S=${ENGINE_S:-110} source bench/device/kv_dtype_ab.sh
  ENGINE_DECODE_TILES="$BEST" ENGINE_S=${ENGINE_S:-110} engine_bench qwen3-8b-kvfp8-best /tmp/shapes/qwen3-8b \
    --prompt-len 2048 --batch-sizes 256 --max-num-batched-tokens 16384 --kv-cache-dtype fp8 --new-tokens 8 \
    --profile --profile-batch 256
fi
kill $CLOCKS || true
(cd "$OUT" && tar czf logs.tgz ./*.log ./clocks.csv && rm -f ./*.log ./clocks.csv)
ls "$OUT"

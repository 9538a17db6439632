# GPU run (issue #29, batch-1 decode), after bench/device/pdl_round.sh: programmatic dependent launch with the next
# kernel let in first thing (ENGINE_PDL_TRIGGER=early) or when a matmul's or attention's programs leave their loop
# (loop). The chain of Qwen3-8B's linear layers (bench/device/pdl_chain.py), then bench.engine.throughput at batch 1
# (random weights, --load-format dummy) in this order while time is left: qwen3-8b and qwen3-30b-a3b off / loop /
# early, qwen3-8b FP8 weights off / loop, qwen3-8b batch 64 off / loop. `bash bench/device/pdl_trigger_round.sh`;
# carries .whl and .gpu. About 9 minutes.
source bench/device/setup.sh
t0=$(date +%s)
timeout 150 python3 bench/device/pdl_chain.py --json "$OUT/pdl-chain-trigger.json" --fp8 2>&1 | grep -v -i warn || true
for shape in qwen3-8b qwen3-30b-a3b; do python3 bench/device/shape_config.py $shape /tmp/shapes/$shape; done
run() {  # run NAME SHAPE PDL TRIGGER ARGS...
  local name=$1 shape=$2 pdl=$3 trigger=$4
  shift 4
  [ $(( $(date +%s) - t0 )) -gt ${BUDGET_S:-520} ] && { echo "skipped $name: out of time"; return; }
  ENGINE_PDL=$pdl ENGINE_PDL_TRIGGER=$trigger ENGINE_S=${ENGINE_S:-80} engine_bench $name /tmp/shapes/$shape \
    --prompt-len 512 --new-tokens 64 --runs 3 "$@" | grep -E "engine batch" || true
}
run qwen3-8b-b1-off qwen3-8b 0 loop --batch-sizes 1
run qwen3-8b-b1-loop qwen3-8b 1 loop --batch-sizes 1
run qwen3-30b-a3b-b1-off qwen3-30b-a3b 0 loop --batch-sizes 1
run qwen3-30b-a3b-b1-loop qwen3-30b-a3b 1 loop --batch-sizes 1
run qwen3-8b-b1-early qwen3-8b 1 early --batch-sizes 1
run qwen3-30b-a3b-b1-early qwen3-30b-a3b 1 early --batch-sizes 1
run qwen3-8b-b1-fp8-off qwen3-8b 0 loop --batch-sizes 1 --quantization fp8
run qwen3-8b-b1-fp8-loop qwen3-8b 1 loop --batch-sizes 1 --quantization fp8
run qwen3-8b-b64-off qwen3-8b 0 loop --batch-sizes 64
run qwen3-8b-b64-loop qwen3-8b 1 loop --batch-sizes 64
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(f"{sys.argv[1]}/qwen3-*.json")):
    d = json.load(open(f))
    for b, r in d["batches"].items():
        print(f.rsplit("/", 1)[1], b, round(r["engine"]["decode_tok_s"], 1))
PY
(cd "$OUT" && tar czf logs.tgz ./*.log ./qwen3-*.json && rm -f ./*.log ./qwen3-*.json)

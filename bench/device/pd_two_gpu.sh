# GPU run: the P/D experiment on TWO GPUs of one host (nvidia-h200-x2). Three set-ups, each swept with
# `python -m bench.gateway.serving` at ISL/OSL 1024/256 and 4096/512, concurrency 1..256:
#   pd-1p1d                 a prefill engine on GPU 0, a decode engine on GPU 1, behind
#                           `atomesh launch --pd-disaggregation --backend atom`; KV and indexer keys over
#                           Mooncake (staged through pinned host memory: the CPU-only wheel)
#   colocated-cache_aware   engine A on GPU 0, engine B on GPU 1, behind `atomesh launch --policy cache_aware`
#   colocated-round_robin   the same two engines behind a second gateway with `--policy round_robin`
# each dense or with `--sparse-attention on` on every engine.
#
# The whole sweep does not fit one 10-minute device command, so it runs as two:
#   PART=dense bash bench/device/pd_two_gpu.sh      (the default)
#   PART=sparse bash bench/device/pd_two_gpu.sh
# Estimate from the one-GPU run (docs/results/pd-one-gpu-runs): per part ~1.5 min of start-up (wheels,
# weights, two engine pairs profiling memory and capturing graphs), ~3 min for 1P1D (its KV pull over
# staged TCP caps it at ~9-16 requests/s, so the 128- and 256-stream passes take ~15-30 s each) and
# ~2.5 min for the two colocated gateways: ~7 min. BUDGET_S (default 510) stops starting passes past
# that many seconds, so the archive is always written within the 10-minute limit; skipped passes are
# listed in runs/skipped-PART.txt.
#
# Knobs (environment): PART, DEVICE (cuda), GPUS ("0 1"), MODEL, ISLS, CONCS, PPC/MIN_PROMPTS/MAX_PROMPTS
# (requests per pass: 2 per stream, 8..256), MAXSEQS (256), MAXLEN (5120), GPU_MEM (0.85) or BLOCKS (KV pool
# per engine), KV_TIMEOUT (120 s), PASS_TIMEOUT (150 s), BUDGET_S (510 s).
#
# After each P/D pass the engines' /metrics before and after give the TTFT split (bench/engine/pd_report.py).
# Every pass gets its own prompt seed, so no pass finds an earlier pass's prompts in the prefix cache.
# Everything lands under $OUT as one archive (the device returns at most 8 files).
#
# .whl must hold Mooncake's CPU-only wheel (mooncake_transfer_engine_non_cuda-*-cp312-*.whl, ~44 MiB; with the
# other wheels, .gpu and .deb the carry stays under 64 MiB); without it the script stops at once.
#
# Plumbing check on a CPU (no GPUs, no CUDA_VISIBLE_DEVICES):
#   DEVICE=cpu GPUS="" MODEL=tiny-random MAXLEN=512 ISLS="64/16" CONCS="1 2" PART=all OUT=/tmp/pd2 \
#     bash bench/device/pd_two_gpu.sh
STARTED=$SECONDS  # the budget counts from here: installing the wheels is part of the 10 minutes
WANT_MODEL=${MODEL:-}
source bench/device/setup.sh
if [ -n "$WANT_MODEL" ]; then MODEL=$WANT_MODEL; fi
if [ -d .deb ]; then
  mkdir -p /tmp/ibv && for f in .deb/*.deb; do dpkg -x "$f" /tmp/ibv; done
  export LD_LIBRARY_PATH=/tmp/ibv/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
fi
python3 -c "import mooncake.engine" || { echo "Mooncake is not importable: put its wheel in .whl (see the header)" >&2; exit 3; }
DEVICE=${DEVICE:-cuda}
PART=${PART:-dense}
GPUS=${GPUS-"0 1"}   # "": leave CUDA_VISIBLE_DEVICES alone (the CPU plumbing check)
ISLS=${ISLS:-"1024/256 4096/512"}
CONCS=${CONCS:-"1 2 4 8 16 32 64 128 256"}
PPC=${PPC:-2}                  # requests per unit of concurrency in a pass,
MIN_PROMPTS=${MIN_PROMPTS:-8}  # at least this many
MAX_PROMPTS=${MAX_PROMPTS:-256}  # and at most this many (256 streams: one request each)
MAXSEQS=${MAXSEQS:-256}
PASS_TIMEOUT=${PASS_TIMEOUT:-150}
BUDGET_S=${BUDGET_S:-510}
case "$PART" in
  dense) MODES="dense" ;; sparse) MODES="sparse" ;; all) MODES="dense sparse" ;;
  *) echo "PART must be dense, sparse or all, not '$PART'" >&2; exit 2 ;;
esac
read -r -a GPU_IDS <<<"$GPUS"
if [ -n "$GPUS" ] && [ "${#GPU_IDS[@]}" -ne 2 ]; then echo "GPUS must name two GPUs, not '$GPUS'" >&2; exit 2; fi
# Each engine has a GPU to itself: it sizes its KV pool from that GPU's memory, unless BLOCKS fixes it.
if [ -n "${BLOCKS:-}" ]; then MEM=(--num-kvcache-blocks "$BLOCKS")
elif [ "$DEVICE" = cuda ]; then MEM=(--gpu-memory-utilization "${GPU_MEM:-0.85}")
else MEM=(--kv-cache-memory-gb "${KV_GB:-0.5}"); fi
R="$OUT/runs"; mkdir -p "$R"
PIDS=()
SEED=0
left() { echo $((BUDGET_S - (SECONDS - STARTED))); }  # seconds of the budget left
wait_http() {  # URL SECONDS: until it answers; fails at once if a process started here has exited
  local p
  for _ in $(seq "$2"); do
    curl -sf "$1" >/dev/null && return 0
    for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null || { echo "process $p exited before $1 answered"; return 1; }; done
    sleep 1
  done
  echo "timeout $1"; return 1
}
engine() {  # NAME GPU_INDEX(0|1) PORT EXTRA...
  local name=$1 gpu=$2 port=$3; shift 3
  local pin=()
  if [ -n "$GPUS" ]; then pin=(env "CUDA_VISIBLE_DEVICES=${GPU_IDS[$gpu]}"); fi
  "${pin[@]}" python3 -m engine.openai_server --model "$MODEL" --served-model-name m --device "$DEVICE" \
    --host 127.0.0.1 --server-port "$port" --max-model-len "${MAXLEN:-5120}" --max-num-seqs "$MAXSEQS" \
    "${MEM[@]}" "$@" >"$R/$name.log" 2>&1 &
  PIDS+=($!)
}
gateway() {  # NAME PORT PROMETHEUS_PORT ARGS...
  local name=$1 port=$2 prom=$3; shift 3
  python3 -m atomesh launch "$@" --host 127.0.0.1 --port "$port" --prometheus-port "$prom" >"$R/gateway-$name.log" 2>&1 &
  PIDS+=($!)
  wait_http "http://127.0.0.1:$port/readiness" 60
}
stop_all() { kill "${PIDS[@]}" 2>/dev/null || true; wait "${PIDS[@]}" 2>/dev/null || true; PIDS=(); }
finish() {  # on every exit, a failed start included: stop what runs, archive what there is
  local rc=$?
  stop_all
  echo "part $PART ended (exit $rc) after $((SECONDS - STARTED)) s"
  (cd "$OUT" && tar czf /tmp/pd-two-gpu.tgz . && rm -rf ./* && mv /tmp/pd-two-gpu.tgz "pd-two-gpu-$PART.tgz")
}
trap finish EXIT
sweep() {  # SETUP URL [DECODE_METRICS_URL PREFILL_METRICS_URL]
  for isl_osl in $ISLS; do
    local isl=${isl_osl%/*} osl=${isl_osl#*/}
    for c in $CONCS; do
      local tag="$1-$isl-$osl-c$c" rem
      rem=$(left)
      SEED=$((SEED + 1))
      if [ "$rem" -lt 15 ]; then echo "$tag" >>"$R/skipped-$PART.txt"; echo "$tag: skipped (budget)"; continue; fi
      if [ -n "${3:-}" ]; then curl -s "$3" >"$R/$tag.decode.before.prom"; curl -s "$4" >"$R/$tag.prefill.before.prom"; fi
      local n=$((PPC * c > MIN_PROMPTS ? PPC * c : MIN_PROMPTS))
      n=$((n < MAX_PROMPTS ? n : MAX_PROMPTS))
      timeout $((rem < PASS_TIMEOUT ? rem : PASS_TIMEOUT)) python3 -m bench.gateway.serving --base-url "$2" \
        --model m --random-input-len "$isl" --random-output-len "$osl" --ignore-eos --num-prompts "$n" \
        --sweep-concurrency "$c" --num-workers 2 --seed "$SEED" --save-result "$R/$tag.json" 2>&1 \
        | grep -E "Output token throughput|Tokens/s per user|Median TTFT" | sed "s/^/$tag: /" || echo "$tag: failed"
      if [ -n "${3:-}" ]; then curl -s "$3" >"$R/$tag.decode.after.prom"; curl -s "$4" >"$R/$tag.prefill.after.prom"; fi
    done
  done
}
python3 - "$R/meta-$PART.json" "$DEVICE" "$PART" "$ISLS" "$CONCS" "$PPC" "$MIN_PROMPTS" "$MAX_PROMPTS" <<'EOF'
import datetime, json, subprocess, sys
path, device, part, isls, concs, ppc, min_prompts, max_prompts = sys.argv[1:]
gpu = subprocess.run(["sh", "-c", "nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null"],
                     capture_output=True, text=True).stdout.split("\n")[0].strip()
json.dump({"device": f"2x {gpu}" if gpu else device, "date": datetime.date.today().isoformat(), "part": part,
           "isl_osl": isls.split(), "concurrency": [int(c) for c in concs.split()],
           "prompts": f"{ppc} x concurrency per pass, at least {min_prompts}, at most {max_prompts}; "
                      "a fresh seed per pass"},
          open(path, "w"), indent=1)
EOF
for mode in $MODES; do
  extra=()
  if [ "$mode" = sparse ]; then extra=(--sparse-attention on); fi
  # 1P1D first (its high-concurrency passes are the longest): prefill on GPU 0, decode on GPU 1.
  # The prefill engine keeps finished KV for KV_TIMEOUT s: at 256 streams pulls queue for tens of seconds.
  engine "prefill-$mode" 0 8011 "${extra[@]}" --kv-transfer-timeout "${KV_TIMEOUT:-120}" \
    --kv-transfer-config '{"kv_role":"kv_producer","kv_connector":"mooncake","handshake_port":6301}'
  engine "decode-$mode" 1 8012 "${extra[@]}" \
    --kv-transfer-config '{"kv_role":"kv_consumer","kv_connector":"mooncake","handshake_port":6302}'
  wait_http http://127.0.0.1:8011/health 300 || exit 1
  wait_http http://127.0.0.1:8012/health 300 || exit 1
  gateway "pd-$mode" 30001 29001 --pd-disaggregation --backend atom --prefill http://127.0.0.1:8011 none \
    --decode http://127.0.0.1:8012
  sweep "pd-1p1d-$mode" http://127.0.0.1:30001 http://127.0.0.1:8012/metrics http://127.0.0.1:8011/metrics
  grep -h -iE "memory backend|staged|error" "$R/prefill-$mode.log" "$R/decode-$mode.log" | head -8 || true
  stop_all
  # Two colocated engines, one per GPU, behind two gateways (cache_aware, round_robin) over the same pair.
  if [ "$(left)" -lt 45 ]; then echo "colocated-$mode: not started (budget)" | tee -a "$R/skipped-$PART.txt"; continue; fi
  engine "colocated-a-$mode" 0 8010 "${extra[@]}"
  engine "colocated-b-$mode" 1 8020 "${extra[@]}"
  wait_http http://127.0.0.1:8010/health 300 || exit 1
  wait_http http://127.0.0.1:8020/health 300 || exit 1
  gateway "cache_aware-$mode" 30000 29000 --worker-urls http://127.0.0.1:8010 http://127.0.0.1:8020 --policy cache_aware
  gateway "round_robin-$mode" 30002 29002 --worker-urls http://127.0.0.1:8010 http://127.0.0.1:8020 --policy round_robin
  sweep "colocated-cache_aware-$mode" http://127.0.0.1:30000
  sweep "colocated-round_robin-$mode" http://127.0.0.1:30002
  stop_all
done

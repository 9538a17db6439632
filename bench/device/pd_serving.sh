# GPU run: the P/D experiment on one GPU. Three set-ups, each swept with `python -m bench.gateway.serving` at ISL/OSL
# 1024/256 and 4096/512: (a) one colocated engine, straight; (b) the same engine behind atomesh; (c) 1 prefill +
# 1 decode engine sharing the GPU behind `atomesh launch --pd-disaggregation --backend atom`, KV and indexer keys
# over Mooncake (staged through pinned host memory: the CPU-only wheel). After each pass the engines' /metrics
# give the TTFT split (prefill, KV pull). `bash bench/device/pd_serving.sh`; everything under $OUT as one archive.
# DEVICE=cpu MODEL=tiny-random ISLS="64/16" CONCS="1 2" runs the same plumbing on a CPU.
# ENGINE_ARGS: more flags for every engine (e.g. --load-format dummy for a model_shapes.py shape); PASS_S: the
# limit of one pass (60 s); SKIP_ATOMESH=1 leaves set-up (b) out; NO_TAR=1 leaves $OUT as files; PPC: requests per
# unit of concurrency in a pass (2). PD_MPS=1 (issue #30): the two P/D engines share the GPU through NVIDIA's MPS
# (a control daemon started after the colocated sweep, which runs without it, and stopped at the end), so that
# their kernels run side by side instead of in time slices. PREFILL_MPS_PCT=N (with PD_MPS=1): the prefill engine
# may use at most N% of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE in its environment), leaving the rest to decode;
# PREFILL_MPS_PRIORITY=1: its kernels are scheduled below the decode engine's (CUDA_MPS_CLIENT_PRIORITY, 1 = below
# normal); COLOC_MPS=1 (with PD_MPS=1): the colocated engine under MPS as well. PIN=1: each process on its own CPU
# cores (taskset; a SmolLM2-shape step is mostly host work, and the processes' scheduling moved its rows by up to
# 0.3x between runs): the colocated and the prefill engine cores 0-3, the decode engine 4-7, the gateways 8-11, the
# load generator 12-15 (on 16 cores or more).
source bench/device/setup.sh
if [ -n "${COLOC_MPS:-}" ] && [ -z "${PD_MPS:-}" ]; then
  echo "COLOC_MPS=1 needs PD_MPS=1 (the daemon, once started for the colocated engine, serves the P/D pair too)" >&2
  exit 2
fi
DEVICE=${DEVICE:-cuda}
if [ "$DEVICE" = cuda ] && [ -f .gpu/mooncake-cuda.tar.xz ]; then
  source bench/device/mooncake_cuda.sh || exit 1  # the CUDA build (setup.sh reset PYTHONPATH; it also unpacks .deb)
elif [ -d .deb ]; then
  mkdir -p /tmp/ibv && for f in .deb/*.deb; do dpkg -x "$f" /tmp/ibv; done
  export LD_LIBRARY_PATH=/tmp/ibv/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
fi
MODEL=${MODEL_OVERRIDE:-$MODEL}
ISLS=${ISLS:-"1024/256 4096/512"}
CONCS=${CONCS:-"1 4 16 64"}
BLOCKS=${BLOCKS:-40000}  # per engine: 14.7 GB of SmolLM2 KV, so two engines share one GPU
R="$OUT/runs"; mkdir -p "$R"
# Every pass gets its own prompt seed, so no pass finds an earlier pass's prompts in the prefix cache
# (with one seed, each pass's prompts began with the previous pass's, and the second set-up on the same
# engine was served from its cache).
SEED=${SEED:-1000}
PIDS=()
pin() {  # CORES: a taskset prefix with PIN=1 (and taskset present), else nothing
  if [ -n "${PIN:-}" ] && command -v taskset >/dev/null && [ "$(nproc)" -ge 16 ]; then echo "taskset -c $1"; fi
}
wait_http() { for _ in $(seq "$2"); do curl -sf "$1" >/dev/null && return 0; sleep 1; done; echo "timeout $1"; return 1; }
engine() {  # NAME PORT EXTRA...
  local name=$1 port=$2 cores=0-3; shift 2
  case "$name" in *decode) cores=4-7 ;; esac
  env ${ENGINE_ENV:-} $(pin $cores) python3 -m engine.openai_server --model "$MODEL" --served-model-name m --device "$DEVICE" --host 127.0.0.1 \
    --server-port "$port" --max-model-len "${MAXLEN:-5120}" --max-num-seqs 128 --num-kvcache-blocks "$BLOCKS" \
    ${ENGINE_ARGS:-} "$@" \
    >"$R/$name.log" 2>&1 &
  PIDS+=($!)
}
stop_all() { kill "${PIDS[@]}" 2>/dev/null || true; wait "${PIDS[@]}" 2>/dev/null || true; PIDS=(); }
sweep() {  # SETUP URL [DECODE_METRICS_URL PREFILL_METRICS_URL [GATEWAY_METRICS_URL]]
  for isl_osl in $ISLS; do
    local isl=${isl_osl%/*} osl=${isl_osl#*/}
    for c in $CONCS; do
      local tag="$1-$isl-$osl-c$c"
      SEED=$((SEED + 1))
      if [ -n "${3:-}" ]; then curl -s "$3" >"$R/$tag.decode.before.prom"; curl -s "$4" >"$R/$tag.prefill.before.prom"; fi
      if [ -n "${5:-}" ]; then curl -s "$5" >"$R/$tag.gateway.before.prom"; fi
      timeout "${PASS_S:-60}" $(pin 12-15) python3 -m bench.gateway.serving --base-url "$2" --model m --random-input-len "$isl" \
        --random-output-len "$osl" --ignore-eos --num-prompts 4 --prompts-per-concurrency "${PPC:-2}" --sweep-concurrency "$c" \
        --seed "$SEED" --save-result "$R/$tag.json" 2>&1 | grep -E "Output token throughput|Tokens/s per user|Median TTFT" \
        | sed "s/^/$tag: /" || echo "$tag: failed"
      if [ -n "${3:-}" ]; then curl -s "$3" >"$R/$tag.decode.after.prom"; curl -s "$4" >"$R/$tag.prefill.after.prom"; fi
      if [ -n "${5:-}" ]; then curl -s "$5" >"$R/$tag.gateway.after.prom"; fi
    done
  done
}
start_mps() {
  # MPS: one server process runs both engines' kernels concurrently on the GPU (without it the driver time-slices
  # the two contexts). The daemon's pipe and log folders are this run's own; it is told to quit at the end.
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/atomesh-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/atomesh-mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || { echo "MPS: nvidia-cuda-mps-control -d failed"; exit 1; }
  trap 'echo quit | nvidia-cuda-mps-control >/dev/null 2>&1 || true' EXIT
  echo "engines under MPS from $1 on (pipe $CUDA_MPS_PIPE_DIRECTORY)" | tee -a "$R/mps.txt"
}
# COLOC_MPS=1 (with PD_MPS=1): the colocated engine runs under MPS too (is an MPS client's step slower by itself?).
[ -z "${COLOC_MPS:-}" ] || start_mps "the colocated engine"
# (a) + (b): one colocated engine, straight and behind atomesh.
engine colocated 8010
wait_http http://127.0.0.1:8010/health 240
$(pin 8-11) python3 -m atomesh launch --worker-urls http://127.0.0.1:8010 --host 127.0.0.1 --port 30000 \
  --prometheus-port 29000 >"$R/gateway-colocated.log" 2>&1 &
PIDS+=($!)
wait_http http://127.0.0.1:30000/readiness 60
sweep colocated http://127.0.0.1:8010
[ -n "${SKIP_ATOMESH:-}" ] || sweep colocated-atomesh http://127.0.0.1:30000
stop_all
# (c): 1P1D through atomesh.
# KVX: more --kv-transfer-config keys for both engines, e.g. KVX='"memory_backend":"direct","max_inflight_pulls":64'
# PREFILL_ARGS: more flags for the prefill engine only (e.g. --max-num-batched-tokens 1024: prompts prefilled in
# chunks, which the decode engine reads as they become final). EARLY_AB=1 sweeps P/D twice: pd-1p1d with
# early_offer off (the prefill leg answered after its prefill) and pd-1p1d-early with it on (the default).
pd_pair() {  # SETUP EXTRA_KV
  local kv="${KVX:+,$KVX}"  # both engines; EXTRA_KV ($2) is the prefill engine's alone
  # pd_report reads the early offers' TTFT split (the pull overlapping the prefill) from this marker.
  case "$2" in *'"early_offer":false'*) ;; *) touch "$R/$1.early" ;; esac
  ENGINE_ENV="${PREFILL_MPS_PCT:+CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$PREFILL_MPS_PCT} ${PREFILL_MPS_PRIORITY:+CUDA_MPS_CLIENT_PRIORITY=$PREFILL_MPS_PRIORITY}" \
    engine "$1-prefill" 8011 ${PREFILL_ARGS:-} \
    --kv-transfer-config "{\"kv_role\":\"kv_producer\",\"kv_connector\":\"mooncake\",\"handshake_port\":6301$kv$2}"
  engine "$1-decode" 8012 --kv-transfer-config "{\"kv_role\":\"kv_consumer\",\"kv_connector\":\"mooncake\",\"handshake_port\":6302$kv}"
  wait_http http://127.0.0.1:8011/health 240 && wait_http http://127.0.0.1:8012/health 240
  $(pin 8-11) python3 -m atomesh launch --pd-disaggregation --backend atom --prefill http://127.0.0.1:8011 none \
    --decode http://127.0.0.1:8012 --host 127.0.0.1 --port 30001 --prometheus-port 29001 >"$R/gateway-$1.log" 2>&1 &
  PIDS+=($!)
  wait_http http://127.0.0.1:30001/readiness 60
  sweep "$1" http://127.0.0.1:30001 http://127.0.0.1:8012/metrics http://127.0.0.1:8011/metrics \
    http://127.0.0.1:29001/metrics
  grep -h -iE "memory backend|staged|error" "$R/$1-prefill.log" "$R/$1-decode.log" | head -8 || true
  stop_all
}
[ -z "${PD_MPS:-}" ] || [ -n "${COLOC_MPS:-}" ] || start_mps "the P/D pair"
if [ -n "${EARLY_AB:-}" ]; then
  pd_pair pd-1p1d ',"early_offer":false'
  pd_pair pd-1p1d-early ''
else
  pd_pair pd-1p1d ''
fi
if [ -n "${PD_MPS:-}" ]; then
  grep -c "NEW CLIENT" "$CUDA_MPS_LOG_DIRECTORY/control.log" | sed 's/^/MPS clients: /' | tee -a "$R/mps.txt" || true
fi
[ -n "${NO_TAR:-}" ] || (cd "$OUT" && tar czf /tmp/results.tgz . && rm -rf ./* && mv /tmp/results.tgz .)

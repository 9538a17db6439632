# GPU run (issue #30): the one-GPU P/D experiment's rows for one model shape, P/D over ipc against one colocated
# engine, after the ipc pull left both engines' event loops (the producer's read desk, the consumer's reader
# threads). One call per shape and ISL/OSL (each fits the 10-minute limit of a call):
#   SHAPE=smollm2 ISLS=1024/256 bash bench/device/pd_one_gpu_rows.sh
#   SHAPE=smollm2 ISLS=4096/512 bash bench/device/pd_one_gpu_rows.sh
#   SHAPE=llama31-8b ISLS=1024/256 bash bench/device/pd_one_gpu_rows.sh
#   SHAPE=llama31-8b ISLS=4096/512 bash bench/device/pd_one_gpu_rows.sh
# EARLY_AB=1 (issue #30, transfer overlapping prefill): P/D twice in the same call, early offers off (pd-1p1d)
# and on (pd-1p1d-early); PREFILL_ARGS="--max-num-batched-tokens 1024" makes the prefill engine chunk the prompts
# the decode engine then reads chunk by chunk. Within a call's 10 minutes at 1024/256: CONCS="1 16 64".
#   OVERLAP_TESTS=1 EARLY_AB=1 CONCS="1 16 64" SHAPE=smollm2 ISLS=1024/256 bash bench/device/pd_one_gpu_rows.sh
# (OVERLAP_TESTS=1: first tests/test_pd_overlap.py on CUDA, into $OUT/cuda-tests-pd-overlap.txt)
#   EARLY_AB=1 CONCS="1 16 64" PREFILL_ARGS="--max-num-batched-tokens 1024" SHAPE=smollm2 ISLS=4096/512 \
#     bash bench/device/pd_one_gpu_rows.sh
# REPEAT=N runs the sweep N times and reports medians, P/D paired with colocated within each run (the SmolLM2 shape's
# rows moved by up to 0.3x between single runs):
#   REPEAT=3 PD_MPS=1 PPC=3 SHAPE=smollm2 ISLS="1024/256 4096/512" bash bench/device/pd_one_gpu_rows.sh
# Writes $OUT/runs (the passes and the engines' /metrics), $OUT/pd-one-gpu-SHAPE-ISL.json (the issue's rows under
# "rows", `python -m bench.engine.pd_report --shape`) and its chart. Merge the rows of the calls into docs/results/pd-one-gpu.json.
# Carries .whl, .gpu (model_shapes.py, smollm2) and the CUDA Mooncake bundle, as pd_ipc_round.sh.
# The plumbing on a CPU: PATH=$VENV/bin:$PATH DEVICE=cpu MODEL_OVERRIDE=tiny-random MAXLEN=512 ISLS=64/16 CONCS="1 2"
#   BLOCKS=2000 OUT=/tmp/rows bash bench/device/pd_one_gpu_rows.sh
set -euo pipefail
SHAPE=${SHAPE:-smollm2}
export ISLS=${ISLS:-1024/256} CONCS=${CONCS:-"1 4 16 32 64"} NO_TAR=1 SKIP_ATOMESH=${SKIP_ATOMESH:-1}
export KVX='"memory_backend":"direct","max_inflight_pulls":64,"protocol":"ipc"'
case "$SHAPE" in
  smollm2)
    export BLOCKS=${BLOCKS:-40000} PASS_S=${PASS_S:-60} ;;
  llama31-8b)
    # 16 GB of weights per engine; 2 MiB of KV per 16-token block: 64 x (4096 + 512) tokens need 18.4k blocks.
    source bench/device/setup.sh
    python3 bench/device/shape_config.py llama31-8b /tmp/shapes/llama31-8b
    export MODEL_OVERRIDE=/tmp/shapes/llama31-8b ENGINE_ARGS="--load-format dummy" BLOCKS=${BLOCKS:-20000}
    export PASS_S=${PASS_S:-120} ;;
  *) echo "SHAPE must be smollm2 or llama31-8b, not $SHAPE" >&2; exit 2 ;;
esac
if [ -n "${OVERLAP_TESTS:-}" ]; then  # the CUDA tests of early offers first (P/D == colocated, aborts leak nothing)
  (set +eu; source bench/device/setup.sh; source bench/device/mooncake_cuda.sh \
    && ENGINE_TEST_DEVICE=cuda ENGINE_TEST_DTYPE=bfloat16 timeout "${TESTS_S:-150}" python3 -m pytest -q \
      -p no:cacheprovider -x tests/test_pd_overlap.py 2>&1 | tee "${OUT:-/tmp/out}/cuda-tests-pd-overlap.txt" | tail -4) || true
fi
OUT=${OUT:-/tmp/out}
# REPEAT=N: the whole sweep N times (engines started afresh each time) into runs-1 .. runs-N; the report takes each
# number's median and pairs P/D with colocated within each run (bench.engine.pd_report's median_of_reps).
if [ "${REPEAT:-1}" -gt 1 ]; then
  dirs=()
  for k in $(seq "$REPEAT"); do
    bash bench/device/pd_serving.sh 2>&1 | grep -v "^I1\|^W1" | tail -8 || true
    rm -rf "$OUT/runs-$k" && mv "$OUT/runs" "$OUT/runs-$k" && dirs+=("$OUT/runs-$k")
  done
else
  bash bench/device/pd_serving.sh 2>&1 | grep -v "^I1\|^W1" | tail -24 || true
  dirs=("$OUT/runs")
fi
tag="$SHAPE-${ISLS//\//-}"; tag=${tag// /_}
name=$([ "$SHAPE" = smollm2 ] && echo smollm2-135m || echo "$SHAPE")
python3 -m bench.engine.pd_report "${dirs[@]}" --shape "$name" --json "$OUT/pd-one-gpu-$tag.json" --png "$OUT/pd-one-gpu-$tag.png" \
  --title "$name, bf16, one H200: colocated vs 1P1D (KV over ipc)" \
  --meta "{\"device\": \"$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo cpu)\", \"date\": \"$(date -u +%F)\", \"command\": \"${REPEAT:+REPEAT=$REPEAT }${PD_MPS:+PD_MPS=1 }${PREFILL_MPS_PCT:+PREFILL_MPS_PCT=$PREFILL_MPS_PCT }${PREFILL_MPS_PRIORITY:+PREFILL_MPS_PRIORITY=$PREFILL_MPS_PRIORITY }${PPC:+PPC=$PPC }${PIN:+PIN=1 }${COLOC_MPS:+COLOC_MPS=1 }${EARLY_AB:+EARLY_AB=1 }${PREFILL_ARGS:+PREFILL_ARGS='$PREFILL_ARGS' }CONCS='$CONCS' SHAPE=$SHAPE ISLS=$ISLS bash bench/device/pd_one_gpu_rows.sh\"}" \
  || echo "pd_report failed here (matplotlib?): run it on the runs folder locally with --shape $name"

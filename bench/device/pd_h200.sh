# GPU run: issue #30 item 3 on one H200, one experiment per device call (each fits 10 minutes).
# NOT RUN YET: written while no GPU time was left; see docs/pd.md ("What waits for a GPU").
#
# Carried from the developer's checkout (git-ignored): .whl/ and .deb/ (bench/device/mooncake_bundle.sh puts
# libcudart's wheel and the verbs packages there), .gpu/mooncake-cuda.tar.xz (the trimmed CUDA Mooncake bundle,
# same script), .gpu/smollm2/ + .gpu/smollm2_shape.py (setup.sh), .gpu/model_shapes.py (../shared/gpu).
#
#   EXP=transfer bash bench/device/pd_h200.sh   # GB/s against the copy limits, 1K/4K/8K, contiguous + scattered
#   EXP=share    bash bench/device/pd_h200.sh   # KV transfer share of TTFT at 4,096 tokens, concurrency 1
#   EXP=concurrency bash bench/device/pd_h200.sh  # 32 P/D requests at once: max_inflight_pulls 1 vs 32
#   EXP=serving SHAPE=smollm2-135m ISLS=1024/256 bash bench/device/pd_h200.sh   # P/D vs colocated, c = 1..64
#
# PROTOCOL forces the transport (ipc: decode maps the prefill engine's pools through CUDA IPC; tcp, rdma,
# nvlink_intra with a source build of Mooncake); unset, the engines choose and log it (ipc: both share this host).
#   EXP=transfer PROTOCOL=ipc bash bench/device/pd_h200.sh   # the IPC pull against the same copy limits
# BACKEND (direct) is the memory backend; INFLIGHT the max_inflight_pulls of both engines.
# Everything lands under $OUT (JSON; bench/engine/pd_report.py turns the serving runs into the chart and
# docs/results/pd-one-gpu.json rows).
source bench/device/setup.sh
source bench/device/mooncake_cuda.sh
EXP=${EXP:?set EXP to transfer, share, concurrency or serving}
BACKEND=${BACKEND:-direct}
INFLIGHT=${INFLIGHT:-64}
PROTO_ARG=() PROTO_KV=""
if [ -n "${PROTOCOL:-}" ]; then PROTO_ARG=(--protocol "$PROTOCOL"); PROTO_KV=",\"protocol\":\"$PROTOCOL\""; fi
nvidia-smi topo -m || true
ls /sys/class/infiniband 2>/dev/null || echo "no RDMA device"

shape_dir() {  # SHAPE -> a random-weight checkpoint of that shape (bf16), tokenizer from SmolLM2's folder
  local dir=/tmp/shapes/$1
  if [ ! -f "$dir/config.json" ]; then
    python3 .gpu/model_shapes.py "$1" "$dir" --tokenizer .gpu/smollm2 >/dev/null
  fi
  echo "$dir"
}

case "$EXP" in
  transfer)
    backends=("$BACKEND" staged)
    if [ "${PROTOCOL:-}" = ipc ]; then backends=("$BACKEND"); fi  # ipc copies from the caches whatever the backend
    for layout_backend in "${backends[@]}"; do
      timeout 180 python3 -m bench.engine.kv_transfer --device cuda --dtype bf16 --backend "$layout_backend" \
        --tokens 1024,4096,8192 --layouts contiguous,scattered --repeats 3 "${PROTO_ARG[@]}" \
        --json "$OUT/pd-transfer-$layout_backend${PROTOCOL:+-$PROTOCOL}.json" \
        | tee "$OUT/pd-transfer-$layout_backend${PROTOCOL:+-$PROTOCOL}.txt"
    done
    timeout 200 python3 -m bench.engine.kv_transfer_concurrency --device cuda --tokens 4096 --concurrency 1,8,32 \
      --backend "$BACKEND" "${PROTO_ARG[@]}" --json "$OUT/pd-transfer-concurrency-$BACKEND.json" | tee "$OUT/pd-transfer-concurrency.txt"
    ;;
  share)
    for shape in ${SHAPES:-smollm2-135m llama31-8b}; do  # SHAPES=one of them when both do not fit 10 minutes
      dir=$(shape_dir "$shape")
      timeout 270 python3 -m bench.engine.pd --model "$dir" --device cuda --dtype bfloat16 --lengths 4096 \
        --modes dense --repeats 3 --num-kvcache-blocks 2048 --memory-backend "$BACKEND" "${PROTO_ARG[@]}" --json "$OUT/pd-share-$shape.json" | tee "$OUT/pd-share-$shape.txt"
    done
    ;;
  concurrency)  # 32 P/D requests at once through one engine pair: max_inflight_pulls 1 against 32
    timeout 500 python3 -m bench.engine.pd_concurrency --model "$(shape_dir smollm2-135m)" --device cuda \
      --tokens 4096 --n 32 --repeats 2 --memory-backend "$BACKEND" "${PROTO_ARG[@]}" --json "$OUT/pd-concurrency-cuda.json"
    ;;
  serving)
    SHAPE=${SHAPE:-smollm2-135m}
    export MODEL_OVERRIDE
    MODEL_OVERRIDE=$(shape_dir "$SHAPE")
    if [ "$SHAPE" != smollm2-135m ]; then export BLOCKS=${BLOCKS:-8000}; fi  # 8B: 128 KiB of KV per token
    export KVX="\"memory_backend\":\"$BACKEND\",\"max_inflight_pulls\":$INFLIGHT$PROTO_KV"
    bash bench/device/pd_serving.sh
    ;;
  *) echo "EXP must be transfer, share, concurrency or serving"; exit 2 ;;
esac

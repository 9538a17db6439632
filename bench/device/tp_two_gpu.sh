# GPU run (issue #34, the engine across GPUs) on TWO GPUs of one host (nvidia-h200-x2). Not run yet: written while
# one GPU was lent. Two parts, each within one 10-minute device command:
#
#   PART=decode bash bench/device/tp_two_gpu.sh   (the default)
#     1. the tensor-parallel tests on CUDA (NCCL, Triton kernels, CUDA graphs capturing the all-reduces):
#        TP=2 and EP=2 equal one rank, colocated (tests/engine/test_tensor_parallel.py);
#     2. bench.engine.throughput on the qwen3-8b shape (random bf16 weights in the Hub layout, model_shapes.py), prompt 512,
#        64 new tokens, batch 1 / 64 / 256: TP=2 on GPUs 0+1 against the same engine on GPU 0 alone (the peer,
#        timed in the same run; the ratio column is TP=2 / TP=1).
#   PART=pd bash bench/device/tp_two_gpu.sh
#     a TP=2 prefill and a TP=2 decode engine sharing GPUs 0+1 (rank r of each on GPU r, 0.42 of each GPU's
#     memory apiece) behind `atomesh launch --pd-disaggregation --backend atom`, against the TP=1 pair (prefill
#     on GPU 0, decode on GPU 1) on the same GPUs: `python -m bench.gateway.serving` at ISL/OSL 1024/256, concurrency
#     1, 8, 64. KV over Mooncake, staged through pinned host memory (the CPU-only wheel): decode rank r's KV
#     heads come from prefill rank r.
#
# Knobs (environment): PART, SHAPE (qwen3-8b), BATCHES ("1 64 256"), CONCS ("1 8 64").
# Carries .whl and .gpu like the other scripts (setup.sh); PART=pd also Mooncake's CPU-only wheel in .whl.
# NVLink multicast stays off (the host's rule): NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1.
STARTED=$SECONDS
source bench/device/setup.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PART=${PART:-decode}
SHAPE=${SHAPE:-qwen3-8b}
BATCHES=${BATCHES:-"1 64 256"}
CONCS=${CONCS:-"1 8 64"}
python3 -c 'import torch; n = torch.cuda.device_count(); print("GPUs", n); assert n >= 2, "needs two GPUs"'
dir=/tmp/shapes/$SHAPE
python3 .gpu/model_shapes.py "$SHAPE" "$dir" --tokenizer .gpu/smollm2 >/dev/null
echo "$SHAPE weights written after $((SECONDS - STARTED)) s"

if [ "$PART" = decode ]; then
  ENGINE_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_tensor_parallel.py \
    2>&1 | tee "$OUT/cuda-tests-tp.txt" | tail -5 || true
  max=$(echo "$BATCHES" | tr ' ' '\n' | sort -n | tail -1)
  # TP=2 first, then (inside the same command) the one-rank peer on GPU 0.
  timeout 420 python3 -m bench.engine.throughput --model "$dir" --device cuda --prompt-len 512 --new-tokens 64 \
    --batch-sizes $BATCHES --runs 2 --no-reference -tp 2 --max-num-batched-tokens $((max * 512)) \
    --json "$OUT/tp2-$SHAPE.json" 2>&1 | grep -v -i warn | tail -12 || true
  exit 0
fi

[ "$PART" = pd ] || { echo "PART must be decode or pd, not '$PART'" >&2; exit 2; }
python3 -c "import mooncake.engine" || { echo "Mooncake is not importable: put its wheel in .whl" >&2; exit 3; }
R="$OUT/runs"; mkdir -p "$R"
PIDS=()
wait_http() {  # URL SECONDS
  for _ in $(seq "$2"); do curl -sf "$1" >/dev/null && return 0; sleep 1; done
  echo "timeout $1"; return 1
}
engine() {  # NAME VISIBLE_GPUS PORT EXTRA...
  local name=$1 gpus=$2 port=$3; shift 3
  env CUDA_VISIBLE_DEVICES="$gpus" python3 -m engine.openai_server --model "$dir" --served-model-name m \
    --device cuda --host 127.0.0.1 --server-port "$port" --max-model-len 2048 --max-num-seqs 64 \
    --kv-transfer-timeout 120 "$@" >"$R/$name.log" 2>&1 &
  PIDS+=($!)
}
stop_all() { kill "${PIDS[@]}" 2>/dev/null || true; wait "${PIDS[@]}" 2>/dev/null || true; PIDS=(); }
trap stop_all EXIT
pd() {  # SETUP PREFILL_GPUS DECODE_GPUS MEM EXTRA...
  local setup=$1 pg=$2 dg=$3 mem=$4; shift 4
  # One after the other: engines sharing a GPU must not profile its memory at the same time.
  engine "prefill-$setup" "$pg" 8011 --gpu-memory-utilization "$mem" "$@" \
    --kv-transfer-config '{"kv_role":"kv_producer","kv_connector":"mooncake","handshake_port":6301}'
  wait_http http://127.0.0.1:8011/health 240 || return 1
  engine "decode-$setup" "$dg" 8012 --gpu-memory-utilization "$mem" "$@" \
    --kv-transfer-config '{"kv_role":"kv_consumer","kv_connector":"mooncake","handshake_port":6302}'
  wait_http http://127.0.0.1:8012/health 240 || return 1
  python3 -m atomesh launch --pd-disaggregation --backend atom --prefill http://127.0.0.1:8011 none \
    --decode http://127.0.0.1:8012 --host 127.0.0.1 --port 30001 --prometheus-port 29001 \
    >"$R/gateway-$setup.log" 2>&1 &
  PIDS+=($!)
  wait_http http://127.0.0.1:30001/readiness 60 || return 1
  for c in $CONCS; do
    timeout 120 python3 -m bench.gateway.serving --base-url http://127.0.0.1:30001 --model m \
      --random-input-len 1024 --random-output-len 256 --ignore-eos --num-prompts $((c > 4 ? 2 * c : 8)) \
      --sweep-concurrency "$c" --num-workers 2 --seed "$c" --save-result "$R/$setup-c$c.json" 2>&1 \
      | grep -E "Output token throughput|Tokens/s per user|Median TTFT" | sed "s/^/$setup c$c: /" || echo "$setup c$c: failed"
  done
  stop_all
}
pd tp2 0,1 0,1 0.42 -tp 2 || true
pd tp1 0 1 0.85 || true
python3 - "$R" "$CONCS" <<'EOF' | tee "$OUT/tp2-pd-ratios.txt"
import json, sys
from pathlib import Path
runs, concs = Path(sys.argv[1]), sys.argv[2].split()
print("concurrency | TP=2 P/D out tok/s | TP=1 P/D out tok/s | ratio")
for c in concs:
    got = {}
    for setup in ("tp2", "tp1"):
        f = runs / f"{setup}-c{c}.json"
        if f.exists():
            data = json.loads(f.read_text())
            rows = data if isinstance(data, list) else [data]
            got[setup] = max(float(r.get("output_throughput", 0) or 0) for r in rows)
    a, b = got.get("tp2"), got.get("tp1")
    print(f"{c:>11} | {a or '-':>18} | {b or '-':>18} | {f'{a / b:.2f}x' if a and b else '-'}")
EOF

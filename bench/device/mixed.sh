# GPU run: the prefix-cache prefill row (median of 3), our engine launching kernel by kernel (--enforce-eager),
# and TPOT/ITL under long prompts arriving while streams decode: mixed steps with a small and the default token
# budget against prefill-first steps. `bash bench/device/mixed.sh` on the GPU machine; writes under $OUT.
source bench/device/setup.sh
if [ "${SKIP_EAGER:-}" != 1 ]; then
timeout 150 python3 -m bench.engine.throughput --model "$MODEL" --device cuda --prompt-len 512 --new-tokens 128 \
  --batch-sizes 1 64 --runs 2 --no-reference --enforce-eager --prefix-row 3000 --json "$OUT/engine-bench-cuda-eager.json" \
  2>&1 | grep -v -i warn | tee "$OUT/engine-bench-cuda-eager.txt" | tail -8 || true
fi
wait_http() { for _ in $(seq "$2"); do curl -sf "$1" >/dev/null && return 0; sleep 1; done; echo "timeout $1"; return 1; }
run_case() {  # NAME ENGINE-FLAGS...
  local name=$1; shift
  python3 -m engine.openai_server --model "$MODEL" --served-model-name smollm2 --device cuda --host 127.0.0.1 \
    --server-port 8010 --max-model-len 8192 --max-num-seqs 64 "$@" >"$OUT/engine-$name.log" 2>&1 &
  local pid=$!
  wait_http http://127.0.0.1:8010/health 180
  timeout 150 python3 -m bench.gateway.serving --base-url http://127.0.0.1:8010 --model smollm2 --random-input-len 4096 \
    --random-output-len 256 --random-range-ratio 0.5 --ignore-eos --num-prompts 64 --max-concurrency 16 \
    --request-rate 8 --percentile-metrics ttft,tpot,itl --metric-percentiles 50,99 \
    --save-result "$OUT/mixed-$name.json" 2>&1 | grep -E "throughput|TTFT|TPOT|ITL|Failed" | sed "s/^/$name: /"
  kill $pid; wait $pid 2>/dev/null || true
}
run_case mixed-1024 --max-num-batched-tokens 1024
run_case mixed-16384 --max-num-batched-tokens 16384
run_case prefill-first --no-enable_chunked_prefill --max-num-batched-tokens 16384

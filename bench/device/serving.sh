# GPU run: one engine (CUDA graphs + Triton) behind atomesh; `python -m bench.gateway.serving` sweeps concurrency at
# ISL/OSL 1024/256 through the gateway, and at concurrency 1 straight to the engine (the gateway's own cost).
# `bash bench/device/serving.sh` on the GPU machine; writes under $OUT.
source bench/device/setup.sh
wait_http() {  # URL SECONDS
  for _ in $(seq "$2"); do curl -sf "$1" >/dev/null && return 0; sleep 1; done
  echo "timed out waiting for $1"; return 1
}
python3 -m engine.openai_server --model "$MODEL" --served-model-name smollm2 --device cuda --host 127.0.0.1 \
  --server-port 8010 --max-model-len 4096 >"$OUT/engine.log" 2>&1 &
wait_http http://127.0.0.1:8010/health 180
python3 -m atomesh launch --worker-urls http://127.0.0.1:8010 --host 127.0.0.1 --port 30000 >"$OUT/gateway.log" 2>&1 &
wait_http http://127.0.0.1:30000/health 60
B=(--model smollm2 --random-input-len 1024 --random-output-len 256 --ignore-eos)
python3 -m bench.gateway.serving --base-url http://127.0.0.1:8010 "${B[@]}" --num-prompts 8 \
  --sweep-concurrency 1 --save-result "$OUT/serving-engine-direct.json" 2>&1 | tail -14
python3 -m bench.gateway.serving --base-url http://127.0.0.1:30000 "${B[@]}" --num-prompts 8 \
  --prompts-per-concurrency 2 --sweep-concurrency 1,2,4,8,16,32,64,128,256 \
  --save-result "$OUT/serving-cuda.json" --plot "$OUT/bench-serving-cuda.png" 2>&1 | tail -60
grep -iE "error|traceback" "$OUT/engine.log" "$OUT/gateway.log" | head -20 || true

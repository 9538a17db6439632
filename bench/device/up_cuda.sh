# GPU run: `atomesh up --device cuda` brings the P/D system up on the one GPU; one chat completion through it.
source bench/device/setup.sh
mkdir -p /tmp/ibv && for f in .deb/*.deb; do dpkg -x "$f" /tmp/ibv; done
export LD_LIBRARY_PATH=/tmp/ibv/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
python3 -m atomesh up --device cuda --model "$MODEL" --log-dir /tmp/uplogs >"$OUT/up.txt" 2>&1 &
UP=$!
for _ in $(seq 240); do curl -sf http://127.0.0.1:30000/readiness >/dev/null && break; sleep 1; done
curl -s http://127.0.0.1:30000/v1/chat/completions -H 'content-type: application/json' \
  -d '{"model":"'"$MODEL"'","messages":[{"role":"user","content":"hi"}],"max_tokens":8}' | tee "$OUT/completion.json"; echo
grep -h -iE "memory backend|cuda graphs|engine:" /tmp/uplogs/*.log | head -6
kill -INT $UP; wait $UP || true
tail -15 "$OUT/up.txt"

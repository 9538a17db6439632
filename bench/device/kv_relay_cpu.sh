# GPU machine, CPU only: the KV relay benchmark (staged and direct, CPU caches) on a quiet machine, pinned
# to 2 cores (as the CI machine) and then on all 16. `bash bench/device/kv_relay_cpu.sh`; writes under $OUT.
# Carries .whl-mc/ (Mooncake's CPU-only wheel) and .deb/ (libibverbs1, libnl-3-200, libnl-route-3-200).
set -euo pipefail
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-mc/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p /tmp/ibv && for f in .deb/*.deb; do dpkg -x "$f" /tmp/ibv; done
export LD_LIBRARY_PATH=/tmp/ibv/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
nproc
for cores in 0,1 0-15; do
  for backend in staged direct; do
    taskset -c "$cores" timeout 140 python3 -m bench.engine.kv_transfer --tokens 1024,4096 --repeats 5 \
      --backend "$backend" --json "$OUT/relay-cpu-${backend}-cores${cores/,/_}.json" 2>&1 | grep -v -i warn \
      | tee -a "$OUT/relay-cpu.txt" | tail -8 || true
  done
done

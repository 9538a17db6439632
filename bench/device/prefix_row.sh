# GPU machine: the prefix-cache row (one 3,000-token prompt: caching off, a miss, a one-block hit, half cached) on
# the device's quiet CPU (2 threads, as CI) and on the GPU. `bash bench/device/prefix_row.sh`; writes under $OUT.
source bench/device/setup.sh
ls /dev/infiniband /sys/class/infiniband 2>&1 | head -5 > "$OUT/rdma-devices.txt" || true
taskset -c 2,3 timeout 400 python3 -m bench.engine.throughput --model "$MODEL" --device cpu --dtype float32 --threads 2 \
  --batch-sizes 1 --prompt-len 64 --new-tokens 4 --runs 5 --no-reference --prefix-row 3000 \
  --json "$OUT/prefix-row-cpu.json" 2>&1 | grep -v -i warn | tee "$OUT/prefix-row-cpu.txt" | tail -3 || true
timeout 150 python3 -m bench.engine.throughput --model "$MODEL" --device cuda --batch-sizes 1 --prompt-len 64 --new-tokens 4 \
  --runs 5 --no-reference --prefix-row 3000 --json "$OUT/prefix-row-cuda.json" 2>&1 | grep -v -i warn \
  | tee "$OUT/prefix-row-cuda.txt" | tail -3 || true

# GPU run (issue #29, batch-1 decode): programmatic dependent launch (ENGINE_PDL, engine/kernels/pdl.py). First the
# linear layers of 36 Qwen3-8B layers chained in one CUDA graph, PDL off / on with 0, 1024 and 4096 columns of weight
# prefetch, bf16 and FP8 (bench/device/pdl_chain.py); then the kernel and MoE CUDA tests with ENGINE_PDL=1; then
# bench.engine.throughput on qwen3-8b (random weights, --load-format dummy) at batch 1, PDL off and on alternating,
# and qwen3-30b-a3b the same if time is left. `bash bench/device/pdl_round.sh`; carries .whl and .gpu. About 8 minutes.
source bench/device/setup.sh
t0=$(date +%s)
timeout 200 python3 bench/device/pdl_chain.py --json "$OUT/pdl-chain.json" --fp8 2>&1 | grep -v -i warn || true
ENGINE_PDL=1 ENGINE_TEST_DEVICE=cuda ENGINE_TEST_DTYPE=bfloat16 timeout 150 python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_kernels.py tests/engine/test_moe.py 2>&1 | tee "$OUT/cuda-tests-pdl.txt" | tail -3 || true
for shape in ${SHAPES:-qwen3-8b qwen3-30b-a3b}; do
  python3 bench/device/shape_config.py $shape /tmp/shapes/$shape
  for p in 0 1 0 1; do
    [ $(( $(date +%s) - t0 )) -gt ${BUDGET_S:-480} ] && { echo "skipped $shape pdl=$p: out of time"; continue; }
    i=$(ls "$OUT" | grep -c "^$shape-b1-pdl$p" || true)
    ENGINE_PDL=$p ENGINE_S=${ENGINE_S:-90} engine_bench $shape-b1-pdl$p-$i /tmp/shapes/$shape --prompt-len 512 \
      --new-tokens 64 --batch-sizes 1 --runs 3 | grep -E "engine batch" || true
  done
done
python3 - "$OUT" <<'PY'
import glob, json, re, sys
for f in sorted(glob.glob(f"{sys.argv[1]}/*-b1-pdl*.json")):
    d = json.load(open(f))
    print(f.rsplit("/", 1)[1], round(d["batches"]["1"]["engine"]["decode_tok_s"], 1))
PY
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)

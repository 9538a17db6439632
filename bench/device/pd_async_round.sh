# GPU run (issues #29, #30) after --async-scheduling (on by default in both the colocated and the P/D engines):
# 1. the one-GPU rows pinned, the P/D engines under MPS: SmolLM2's shape at 1024/256 (its P/D rows were 0.85-0.96x
#    colocated, a small model's step being mostly host work), then the llama31-8b shape at 1024/256 at 16, 32 and
#    64 streams (TPOT p50 was 1-10% above colocated there); 2. qwen3-30b-a3b (random weights, --load-format dummy)
#    decode tok/s with async scheduling off and on at batch 1 and 64 (--async-ab).
# `bash bench/device/pd_async_round.sh`; carries .whl, .gpu and .deb. About 9 minutes.
set +e
export PYTHONUNBUFFERED=1 PD_MPS=1 PIN=1 PPC=${PPC:-3}
OUT=${OUT:-/tmp/out}
SHAPE=smollm2 ISLS=1024/256 CONCS="1 4 16 64" PASS_S=40 timeout 210 bash bench/device/pd_one_gpu_rows.sh 2>&1 \
  | grep -v "^pd-\|^colocated" | tail -8
(cd "$OUT" && mv runs runs-smollm2)
SHAPE=llama31-8b ISLS=1024/256 CONCS="16 32 64" PASS_S=60 BLOCKS=12000 timeout 230 \
  bash bench/device/pd_one_gpu_rows.sh 2>&1 | grep -v "^pd-\|^colocated" | tail -7
(cd "$OUT" && mv runs runs-llama31-8b; tar czf runs.tgz runs-* && rm -rf runs-*)
source bench/device/setup.sh >/dev/null
python3 bench/device/shape_config.py qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b
ENGINE_S=130 engine_bench qwen3-30b-a3b-async /tmp/shapes/qwen3-30b-a3b --prompt-len 512 --new-tokens 64 \
  --batch-sizes 1 64 --async-ab --runs 3
grep -h "async scheduling" "$OUT"/*.log
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)
ls "$OUT"

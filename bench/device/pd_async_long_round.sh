# GPU run (issue #30) after --async-scheduling: the one-GPU rows at 4096/512, pinned, the P/D engines under MPS:
# the llama31-8b shape at 1, 4, 16 and 64 streams and SmolLM2's shape at 1, 16 and 64, then SmolLM2 at 1024/256 with
# 16 streams again (0.8998x in pd_async_round.sh). `bash bench/device/pd_async_long_round.sh`; carries .whl, .gpu
# and .deb. About 9 minutes.
set +e
export PYTHONUNBUFFERED=1 PD_MPS=1 PIN=1 PPC=${PPC:-3}
OUT=${OUT:-/tmp/out}
SHAPE=llama31-8b ISLS=4096/512 CONCS="1 4 16 64" PASS_S=70 BLOCKS=12000 timeout 290 \
  bash bench/device/pd_one_gpu_rows.sh 2>&1 | grep -v "^pd-\|^colocated" | tail -9
(cd "$OUT" && mv runs runs-llama31-8b)
SHAPE=smollm2 ISLS=4096/512 CONCS="1 16 64" PASS_S=40 timeout 150 bash bench/device/pd_one_gpu_rows.sh 2>&1 \
  | grep -v "^pd-\|^colocated" | tail -7
(cd "$OUT" && mv runs runs-smollm2-4096)
SHAPE=smollm2 ISLS=1024/256 CONCS="16" PASS_S=40 timeout 90 bash bench/device/pd_one_gpu_rows.sh 2>&1 \
  | grep -v "^pd-\|^colocated" | tail -3
(cd "$OUT" && mv runs runs-smollm2-1024-c16; tar czf runs.tgz runs-* && rm -rf runs-*)
ls "$OUT"

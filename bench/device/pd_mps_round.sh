# GPU run (issue #30): the one-GPU rows with the P/D engines under MPS (colocated without it), early offers on
# (the default), three requests per unit of concurrency: the SmolLM2 shape at 1024/256 and 4096/512, then the
# llama31-8b shape at 1024/256; first the early-offer CUDA tests. `bash bench/device/pd_mps_round.sh`; carries .whl,
# .gpu and .deb. The llama31-8b shape's 4096/512 rows are a call of their own:
#   PD_MPS=1 PPC=3 SHAPE=llama31-8b ISLS=4096/512 bash bench/device/pd_one_gpu_rows.sh
set +e
export PYTHONUNBUFFERED=1 PD_MPS=1 PPC=${PPC:-3}
OUT=${OUT:-/tmp/out}
OVERLAP_TESTS=1 TESTS_S=120 SHAPE=smollm2 ISLS="1024/256 4096/512" PASS_S=50 timeout 300 \
  bash bench/device/pd_one_gpu_rows.sh 2>&1 | grep -v "^pd-\|^colocated" | tail -24
(cd "$OUT" && mv runs runs-smollm2)
SHAPE=llama31-8b ISLS=1024/256 PASS_S=60 BLOCKS=12000 timeout 270 bash bench/device/pd_one_gpu_rows.sh 2>&1 \
  | grep -v "^pd-\|^colocated" | tail -14
(cd "$OUT" && mv runs runs-llama31-8b && tar czf runs.tgz runs-* && rm -rf runs-*)
ls "$OUT"

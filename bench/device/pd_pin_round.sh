# GPU run (issue #30): the one-GPU rows with every process on its own CPU cores (PIN=1) and the P/D engines under
# MPS: SmolLM2's shape at 1024/256 twice (its rows moved by up to 0.3x between unpinned runs), then the llama31-8b
# shape at 1024/256 with the prefill engine's kernels below the decode engine's (PREFILL_MPS_PRIORITY=1: TPOT p50 was
# 2-9% above colocated at 4-64 streams). `bash bench/device/pd_pin_round.sh`; carries .whl, .gpu and .deb.
set +e
export PYTHONUNBUFFERED=1 PD_MPS=1 PIN=1 PPC=${PPC:-3}
OUT=${OUT:-/tmp/out}
REPEAT=2 SHAPE=smollm2 ISLS=1024/256 PASS_S=40 timeout 320 bash bench/device/pd_one_gpu_rows.sh 2>&1 \
  | grep -v "^pd-\|^colocated" | tail -14
(cd "$OUT" && mkdir -p runs-smollm2 && mv runs-? runs-smollm2/ 2>/dev/null)
PREFILL_MPS_PRIORITY=1 SHAPE=llama31-8b ISLS=1024/256 CONCS="4 16 64" PASS_S=60 BLOCKS=12000 timeout 250 \
  bash bench/device/pd_one_gpu_rows.sh 2>&1 | grep -v "^pd-\|^colocated" | tail -8
(cd "$OUT" && mv runs runs-llama31-8b; tar czf runs.tgz runs-* && rm -rf runs-*)
ls "$OUT"

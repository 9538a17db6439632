# GPU run (issue #30): is an MPS client's decode step slower by itself? SmolLM2's shape at 1024/256, pinned, the
# colocated engine without MPS and then under MPS (COLOC_MPS=1), P/D under MPS both times; then the llama31-8b shape
# with the prefill engine capped at half the SMs (PREFILL_MPS_PCT=50) for TPOT. `bash bench/device/pd_mps_cap_round.sh`;
# carries .whl, .gpu and .deb.
set +e
export PYTHONUNBUFFERED=1 PD_MPS=1 PIN=1 PPC=${PPC:-3}
OUT=${OUT:-/tmp/out}
for coloc in "" 1; do
  COLOC_MPS=$coloc SHAPE=smollm2 ISLS=1024/256 CONCS="1 16 64" PASS_S=40 timeout 150 bash bench/device/pd_one_gpu_rows.sh \
    2>&1 | grep -v "^pd-\|^colocated" | tail -7
  (cd "$OUT" && mv runs "runs-smollm2-coloc-mps${coloc:-0}" && for f in pd-one-gpu-smollm2-1024-256.*; do
    mv "$f" "${f/smollm2/smollm2-coloc-mps${coloc:-0}}"; done)
done
PREFILL_MPS_PCT=50 SHAPE=llama31-8b ISLS=1024/256 CONCS="16 64" PASS_S=60 BLOCKS=12000 timeout 220 \
  bash bench/device/pd_one_gpu_rows.sh 2>&1 | grep -v "^pd-\|^colocated" | tail -6
(cd "$OUT" && mv runs runs-llama31-8b; tar czf runs.tgz runs-* && rm -rf runs-*)
ls "$OUT"

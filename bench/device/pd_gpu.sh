# GPU run: the CUDA tests of the kernels, the KV relay and P/D (float32 and bfloat16), mixed steps under load,
# and bench.engine.pd_gpu (staged relay vs raw Mooncake; TTFT split). `bash bench/device/pd_gpu.sh`; under $OUT.
# Carries .deb/ too: Debian's libibverbs1, libnl-3-200, libnl-route-3-200 (the Mooncake wheel links them).
source bench/device/setup.sh
mkdir -p /tmp/ibv && for f in .deb/*.deb; do dpkg -x "$f" /tmp/ibv; done
export LD_LIBRARY_PATH=/tmp/ibv/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
python3 -c "import mooncake.engine; print('mooncake ok')"
ENGINE_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_kernels.py \
  tests/engine/test_kv_transfer.py tests/engine/test_disagg_reserve.py tests/test_pd_engine.py 2>&1 \
  | tee "$OUT/cuda-tests-pd.txt" | tail -8 || true
ENGINE_TEST_DEVICE=cuda ENGINE_TEST_DTYPE=bfloat16 timeout 120 python3 -m pytest -q -p no:cacheprovider \
  tests/test_pd_engine.py 2>&1 | tee "$OUT/cuda-tests-pd-bf16.txt" | tail -4 || true
SKIP_EAGER=1 bash bench/device/mixed.sh 2>&1 | grep -E "TPOT|ITL|TTFT|Output token" | grep -E "P99|Median|Output" || true
mkdir -p "$OUT/pd" && timeout 220 python3 -m bench.engine.pd_gpu --model "$MODEL" --out "$OUT/pd" 2>&1 | tail -30 || true
# Everything back as one archive (the machine returns at most 8 files).
(cd "$OUT" && tar czf /tmp/results.tgz . && rm -rf ./* && mv /tmp/results.tgz .)

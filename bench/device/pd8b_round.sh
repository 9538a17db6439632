# GPU run of 2026-12-02 (issues #30 and #35), one call: the CUDA tests of the ipc pull (with the copy kernel warmed
# at the decode engine's start), the one-GPU serving rows of the llama31-8b shape at 4096/512 (the KV share of TTFT
# at concurrency 1 is the 8B figure), and the speculative-decoding CUDA tests.
# `bash bench/device/pd8b_round.sh`; carries .whl, .gpu and .deb. The 1024/256 rows were the call before:
# `SHAPE=llama31-8b ISLS=1024/256 PASS_S=70 BLOCKS=12000 bash bench/device/pd_one_gpu_rows.sh`.
source bench/device/setup.sh
source bench/device/mooncake_cuda.sh || exit 1
set +e
ENGINE_TEST_DEVICE=cuda ENGINE_TEST_DTYPE=bfloat16 timeout ${TESTS_S:-120} python3 -m pytest -q -p no:cacheprovider -x \
  tests/engine/test_kv_block_copy.py tests/test_pd_ipc.py 2>&1 | tee "$OUT/cuda-tests-pd-warm.txt" | tail -4
SHAPE=llama31-8b ISLS=4096/512 CONCS=${CONCS:-"1 4 16 32 64"} PASS_S=${PASS_S:-90} timeout ${ROWS_S:-400} \
  bash bench/device/pd_one_gpu_rows.sh 2>&1 | tail -16
grep -h "warmed" "$OUT"/runs/decode.log | head -2
ENGINE_TEST_DEVICE=cuda timeout ${SPEC_S:-150} python3 -m pytest -q -p no:cacheprovider tests/engine/test_spec_decode_kernels.py \
  tests/engine/test_spec_eagle3.py 2>&1 | tee "$OUT/cuda-tests-spec-graphs.txt" | tail -6
(cd "$OUT" && tar czf runs.tgz runs && rm -rf runs)

# GPU run (issue #30), everything of the intra-host KV path in one device call (the session's last minutes):
# decode == colocated through ipc and through the CUDA Mooncake bundle (tests), the ipc pull against the copy
# limits, the KV share of TTFT at 4,096 tokens on the llama31-8b shape, and P/D against colocated serving on
# the SmolLM2 shape (1024/256, concurrency 1/16/64). Carries .whl, .gpu and .deb.
# `bash bench/device/pd_ipc_round.sh` (SKIP_TESTS, SKIP_TRANSFER, SKIP_SERVING leave a part out)
source bench/device/setup.sh
source bench/device/mooncake_cuda.sh || exit 1
[ -n "${SKIP_TESTS:-}" ] || ENGINE_TEST_DEVICE=cuda ENGINE_TEST_DTYPE=bfloat16 timeout ${TESTS_S:-130} python3 -m pytest -q -p no:cacheprovider \
  tests/test_pd_ipc.py tests/test_pd_families.py tests/engine/test_kv_block_copy.py 2>&1 | tee "$OUT/cuda-tests-pd.txt" | tail -4 || true
[ -n "${SKIP_TRANSFER:-}" ] || timeout ${TRANSFER_S:-70} python3 -m bench.engine.kv_transfer --device cuda --dtype bf16 --backend direct \
  --tokens 1024,4096,8192 --layouts contiguous,scattered --repeats 3 --protocol ipc \
  --json "$OUT/pd-transfer-direct-ipc.json" 2>&1 | grep -v "^I1\|^W1" | tail -14 || true
python3 bench/device/shape_config.py llama31-8b /tmp/shapes/llama31-8b
timeout ${SHARE_S:-150} python3 -m bench.engine.pd --model /tmp/shapes/llama31-8b --device cuda --dtype bfloat16 \
  --lengths 4096 --modes dense --repeats 3 --num-kvcache-blocks 2048 --memory-backend direct --protocol ipc \
  --engine-arg=--load-format=dummy --json "$OUT/pd-share-llama31-8b-ipc.json" 2>&1 | grep -v "^I1\|^W1" | tail -8 || true
export ISLS=1024/256 CONCS="1 16 64" KVX='"memory_backend":"direct","max_inflight_pulls":64,"protocol":"ipc"'
[ -n "${SKIP_SERVING:-}" ] || timeout ${SERVING_S:-210} bash bench/device/pd_serving.sh 2>&1 | grep -v "^I1\|^W1" | tail -14 || true

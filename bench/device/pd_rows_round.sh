# GPU run of 2026-12-02 (issues #30 and #35), one call: the CUDA tests of the new ipc pull (one-launch block copy,
# P/D == colocated over ipc), the one-GPU serving rows on the SmolLM2 shape (1024/256) after the pull left the
# engines' event loops, and the verify step's cost against a plain step on llama31-8b at batch 1 (dummy weights).
# `bash bench/device/pd_rows_round.sh`; carries .whl, .gpu and .deb.
source bench/device/setup.sh
source bench/device/mooncake_cuda.sh || exit 1
set +e
ENGINE_TEST_DEVICE=cuda ENGINE_TEST_DTYPE=bfloat16 timeout ${TESTS_S:-90} python3 -m pytest -q -p no:cacheprovider -x \
  tests/engine/test_kv_block_copy.py tests/test_pd_ipc.py 2>&1 | tee "$OUT/cuda-tests-pd-desk.txt" | tail -4
SHAPE=smollm2 ISLS=1024/256 PASS_S=${PASS_S:-40} timeout ${ROWS_S:-330} bash bench/device/pd_one_gpu_rows.sh 2>&1 | tail -30
python3 bench/device/shape_config.py llama31-8b /tmp/shapes/llama31-8b
timeout ${VERIFY_S:-100} python3 -m bench.engine.spec --verify-cost --model /tmp/shapes/llama31-8b --load-format dummy \
  --device cuda --prompt-len 512 --max-k 5 --batch-sizes 1 --steps 20 --json "$OUT/spec-verify-llama31-8b.json" 2>&1 \
  | grep -v -i warn | tail -12

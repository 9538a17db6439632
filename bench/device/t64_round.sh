# GPU run (issue #29, batch 64 and batch 1): the skinny-matmul kernel at 64 tokens, split along K (the last program of
# a row tile to finish sums the partials), swept against cuBLAS on qwen3-8b's layers (fp8_tune.py --only gemv64,
# writing the winners' tile table), then qwen3-8b decode steps (random weights, --load-format dummy, prompt 512,
# bf16) at batch 64 on cuBLAS and on that table, and at batch 1, each profiled; first the CUDA tests of the kernels
# (split decode attention now merged in its kernel). `bash bench/device/t64_round.sh`; carries .whl and .gpu.
# About 9 minutes. JSON and logs under $OUT.
source bench/device/setup.sh
ENGINE_TEST_DEVICE=cuda timeout ${TESTS_S:-70} python3 -m pytest -q -p no:cacheprovider tests/engine/test_kernels.py \
  -k "skinny or 64_tokens or decode_and_prompt or splits or unmasked or fp8_cache or strides or graph_replay" 2>&1 \
  | tee "$OUT/cuda-tests-t64.txt" | tail -4 || true
timeout ${TUNE_S:-170} python3 bench/device/fp8_tune.py --only gemv64 --kinds ${KINDS:-bf16} --seconds ${PART_S:-150} \
  --json "$OUT/gemv64.json" --tiles "$OUT/t64-tiles.json" 2>&1 | grep -v -i warn | tee "$OUT/gemv64.log" \
  | grep gemv64 || true
cat "$OUT/t64-tiles.json" || echo '{}' >"$OUT/t64-tiles.json"
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b
ENGINE_S=${B64_S:-90} engine_bench qwen3-8b-b64-cublas /tmp/shapes/qwen3-8b --prompt-len 512 --new-tokens 32 \
  --batch-sizes 64 --profile --profile-batch 64 | grep -E "engine batch|decode step|_paged|_gemv|nvjet" || true
ENGINE_GEMV_TILES=$OUT/t64-tiles.json ENGINE_S=${T64_S:-120} engine_bench qwen3-8b-b64-t64 /tmp/shapes/qwen3-8b \
  --prompt-len 512 --new-tokens 32 --batch-sizes 64 --profile --profile-batch 64 \
  | grep -E "engine batch|decode step|_paged|_gemv|nvjet" || true
ENGINE_S=${B1_S:-70} engine_bench qwen3-8b-b1 /tmp/shapes/qwen3-8b --prompt-len 512 --new-tokens 64 --batch-sizes 1 \
  --profile | grep -E "engine batch|decode step|_paged" || true
cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log

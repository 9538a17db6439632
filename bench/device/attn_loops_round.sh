# GPU run (issue #29): the decode attention loop with fewer instructions a key, and FP8's 1-warp programs under a
# register cap. 1. the CUDA kernel tests; 2. decode attention alone by loop form and register cap (fp8_tune.py --only
# loops: every tile masked and rescaled, whole tiles unmasked, a lazy rescale, both; FP8 capped at 168 and 128
# registers; batch 256 / 2K, 64 / 544, 16 / 8K, 1 / 4K; bf16 and FP8 caches); 3. qwen3-8b (random weights,
# --load-format dummy) in the engine: a decode step of 256 sequences at 2K context, bf16 against FP8 KV
# (kv_dtype_ab.sh), the FP8 step again under ENGINE_DECODE_TILES=$FP8_CAP (default: 128 registers), then prompt 512
# at batch 1 and 64 (bf16). `bash bench/device/attn_loops_round.sh`; carries .whl and .gpu. About 7 minutes. JSON and
# logs under $OUT.
source bench/device/setup.sh
ENGINE_TEST_DEVICE=cuda timeout ${TESTS_S:-90} python3 -m pytest -q -p no:cacheprovider tests/engine/test_kernels.py \
  -k "attention or fp8_cache or unmasked or override or sized_from or strides" 2>&1 \
  | tee "$OUT/cuda-tests-loops.txt" | tail -4 || true
timeout ${TUNE_S:-165} python3 bench/device/fp8_tune.py --only loops --seconds ${PART_S:-150} \
  --json "$OUT/attention-loops.json" 2>&1 | grep -v -i warn | tee "$OUT/attention-loops.log" | grep best || true
ENGINE_S=${ENGINE_S:-100} source bench/device/kv_dtype_ab.sh  # writes the qwen3-8b shape too
ENGINE_DECODE_TILES=${FP8_CAP:-'{"fp8": {"max_registers": 128}}'} ENGINE_S=${ENGINE_S:-100} engine_bench \
  qwen3-8b-kvfp8-cap /tmp/shapes/qwen3-8b --prompt-len 2048 --batch-sizes 256 --max-num-batched-tokens 16384 \
  --kv-cache-dtype fp8 --new-tokens 8 --profile --profile-batch 256 | grep "decode step" || true
ENGINE_S=${ENGINE_S:-100} engine_bench qwen3-8b-b1-b64 /tmp/shapes/qwen3-8b --prompt-len 512 --new-tokens 32 \
  --batch-sizes 1 64

# GPU run (issue #29, FP8 KV, sixth round): an e4m3 cache's V tiles widened to fp16 in registers before the dot
# (`v_regs`, engine.kernels.triton_ops), against Triton's own widening, which reads the FP8 tile back from shared
# memory a byte at a time. The CUDA kernel and attention tests, then decode attention alone (fp8_tune.py, head-major
# cache: bf16, FP8 widened in registers, FP8 left to Triton, over tiles), then qwen3-8b (random weights,
# --load-format dummy) at batch 256 with 2,048-token prompts, bf16 against FP8 KV in the engine. About 9 minutes.
# `bash bench/device/fp8kv_regs_round.sh`; carries .whl and .gpu (setup.sh). JSON and logs under $OUT.
source bench/device/setup.sh
ENGINE_TEST_DEVICE=cuda timeout ${TESTS_S:-120} python3 -m pytest -q -p no:cacheprovider -x \
  tests/engine/test_kernels.py -k "attention or fp8 or kernels_generates or cache" 2>&1 \
  | tee "$OUT/cuda-tests-kv.txt" | tail -4 || true
timeout ${TUNE_S:-200} python3 bench/device/fp8_tune.py --only attention --layouts head --seconds ${PART_S:-180} \
  --json "$OUT/attention-vregs.json" 2>&1 | grep -v -i warn | tee "$OUT/attention-vregs.log" \
  | grep -v "^attention [0-9]" || true
ENGINE_S=${ENGINE_S:-80} MEASURE=throughput source bench/device/kv_dtype_ab.sh

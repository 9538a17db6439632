# GPU run (issue #29, batch-1 skinny matmuls): swap-AB, CUDA-core and PDL variants against the engine's kernel,
# per projection of qwen3-8b and over a chain of a step's 36 layers, bf16 and FP8 weights.
# `bash bench/device/gemv_swap_round.sh`; carries .whl and .gpu (setup.sh). About 6 minutes.
source bench/device/setup.sh
timeout ${TUNE_S:-420} python3 bench/device/gemv_swap.py --seconds ${PART_S:-330} --kinds ${KINDS:-fp8,bf16} \
  --json "$OUT/gemv-swap.json" 2>&1 | grep -v -i warn || true

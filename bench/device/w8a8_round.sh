# GPU run (issue #29): FP8 x FP8 at one token on the warp-group MMA, the activation quantized before the kernel
# (bench/device/w8a8_token.py), against the engine's pick for each of qwen3-8b's projections, then a chain of 36
# layers. `bash bench/device/w8a8_round.sh`; carries .whl. About 5 minutes.
source bench/device/setup.sh
set +e
timeout ${BENCH_S:-330} python3 bench/device/w8a8_token.py --json "$OUT/w8a8-token.json" --seconds ${SECONDS_W8A8:-270} \
  2>&1 | grep -v -i warn | tee "$OUT/w8a8-token.log" | tail -40

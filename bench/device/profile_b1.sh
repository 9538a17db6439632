# GPU run (issue #29): where a batch-1 decode step goes, kernel by kernel (bench.engine.throughput --profile), on the
# qwen3-8b and qwen3-30b-a3b shapes (random weights drawn on the device, --load-format dummy).
# `bash bench/device/profile_b1.sh`; carries .whl and .gpu (setup.sh).
source bench/device/setup.sh
for shape in ${SHAPES:-qwen3-8b qwen3-30b-a3b}; do
  python3 bench/device/shape_config.py $shape /tmp/shapes/$shape
  timeout ${BENCH_S:-100} python3 -m bench.engine.throughput --model /tmp/shapes/$shape --load-format dummy --device cuda \
    --prompt-len 512 --new-tokens 32 --batch-sizes 1 64 --runs 1 --no-reference --profile \
    --json "$OUT/$shape-profile.json" 2>&1 | grep -v -i warn | tail -34 || true
done

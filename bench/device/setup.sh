# Sourced at the start of every GPU-machine run (the machine starts bare and cannot reach a registry).
#
# Expects, carried from the developer's checkout (both git-ignored):
#   .whl/          wheels of the Python packages the GPU image lacks, made with
#                  `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux... -d .whl ...`
#                  (the image also lacks pytest-asyncio, without which the engine's async tests fail: carry it too;
#                  the P/D tests need Mooncake's CUDA build as well, see mooncake_cuda.sh)
#   .gpu/smollm2/  config + tokenizer of SmolLM2-135M (`python smollm2_shape.py meta .gpu/smollm2`)
#                  and .gpu/smollm2_shape.py, which writes random bf16 weights of that shape there.
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -d .whl ] && [ -z "${NO_WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
if [ -d .gpu/smollm2 ] && [ ! -f .gpu/smollm2/model.safetensors ]; then
  python3 .gpu/smollm2_shape.py weights .gpu/smollm2 >/dev/null
fi
MODEL=$PWD/.gpu/smollm2
if command -v nvidia-smi >/dev/null; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; fi
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'

# engine_bench NAME MODEL_DIR ARGS...: bench.engine.throughput on the GPU with random weights of MODEL_DIR's shape
# (--load-format dummy), one run, no transformers reference, within ${ENGINE_S:-110} s. JSON in $OUT/NAME.json, the
# whole log in $OUT/NAME.log; its figures (table rows, decode-step profile) are printed.
engine_bench() {
  local name=$1 model=$2
  shift 2
  timeout "${ENGINE_S:-110}" python3 -m bench.engine.throughput --model "$model" --load-format dummy --device cuda \
    --runs 1 --no-reference --json "$OUT/$name.json" "$@" 2>&1 | grep -v -i warn | tee "$OUT/$name.log" \
    | grep -E "^ +[0-9]+ \||engine batch|decode step|^ +[0-9.]+  " | head -40 || true
}

# decode_figures: each $OUT/qwen3-*.json's decode tok/s per batch size, one line each.
decode_figures() {
  python3 - "$OUT" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(f"{sys.argv[1]}/qwen3-*.json")):
    for b, r in json.load(open(f))["batches"].items():
        print(f.rsplit("/", 1)[1], b, round(r["engine"]["decode_tok_s"], 1))
PY
}

# ab_bench NAME MODEL_DIR MODULE.CONSTANT=VALUE... -- ARGS...: bench.engine.throughput with those constants of the
# engine's modules set first (bench/device/launch_ab.py; an A/B in separate processes), random weights of MODEL_DIR's
# shape, 512-token prompts, within ${ENGINE_S:-90} s. JSON in $OUT/NAME.json, the log in $OUT/NAME.log; its table
# rows and decode-step lines are printed.
ab_bench() {
  local name=$1 model=$2
  shift 2
  local consts=()
  while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do consts+=("$1"); shift; done
  shift
  timeout "${ENGINE_S:-90}" python3 bench/device/launch_ab.py "${consts[@]}" -- --model "$model" --load-format dummy \
    --device cuda --no-reference --prompt-len 512 --json "$OUT/$name.json" "$@" 2>&1 | grep -v -i warn \
    > "$OUT/$name.log"
  grep -E "^ +[0-9]+ \||decode step" "$OUT/$name.log" | head -3
}

# log_clocks MS: the SM and memory clocks, power, temperature and throttle reasons every MS milliseconds into
# $OUT/clocks.csv, in the background until `kill $CLOCKS`.
log_clocks() {
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -lms "$1" > "$OUT/clocks.csv" 2>&1 &
  CLOCKS=$!
}

# cuda_tests EXPR FILE...: the CUDA tests of FILE... whose names match pytest's -k EXPR (never the sampler's: the image
# lacks xgrammar), within 200 s; the summary in $OUT/cuda-tests.txt. SKIP_TESTS=1 skips them.
cuda_tests() {
  local expr=$1
  shift
  [ -z "${SKIP_TESTS:-}" ] || return 0
  ENGINE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider "$@" -k "($expr) and not sampler" 2>&1 \
    | grep -v -i "warn\|^ *$\|self._warn\|^--" | tail -25 | tee "$OUT/cuda-tests.txt" || true
}

# shape_row NAME SHAPE MODULE.CONSTANT=VALUE... -- ARGS...: ab_bench NAME on /tmp/shapes/SHAPE (shape_config.py's
# output, written first if missing), its table row printed after NAME.
shape_row() {
  local name=$1 shape=$2
  shift 2
  [ -d "/tmp/shapes/$shape" ] || python3 bench/device/shape_config.py "$shape" "/tmp/shapes/$shape" >/dev/null
  ab_bench "$name" "/tmp/shapes/$shape" "$@" | grep -E "^ +[0-9]+ \|" | sed "s/^/$name /" || true
}

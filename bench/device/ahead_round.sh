# GPU run (issue #29): skinny matmuls that read their weight ahead. The one-token FP8 kernel reads each weight slice an
# iteration before its use and its first slice before PDL's wait; the tensor-core kernel reads its first slice before
# the wait (engine.kernels.gemv TOKEN_AHEAD / GEMV_AHEAD, 1 against 0 in the same call). CUDA tests of the skinny
# matmuls and PDL; the one-token FP8 tiles, today's read both ways and a sweep read ahead; the 36-layer linear chain
# (bf16 and FP8, PDL off and on); qwen3-8b at batch 1, bf16 and FP8 weights, each setting its own process.
# `bash bench/device/ahead_round.sh`; carries .whl and .gpu. About 8 minutes.
source bench/device/setup.sh
set +e
ENGINE_TEST_DEVICE=cuda ENGINE_TEST_DTYPE=bfloat16 timeout ${TESTS_S:-90} python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_kernels.py tests/engine/test_pdl.py -k "skinny or one_token or pdl or wait or launch or first" \
  2>&1 | tee "$OUT/cuda-tests-ahead.txt" | tail -3
timeout 150 python3 bench/device/gemv_swap.py --token-tiles "$OUT/token-tiles.json" --seconds ${SWEEP_S:-110} \
  --json "$OUT/token-sweep.json" 2>&1 | grep -v -i warn
cat "$OUT/token-tiles.json"
for a in 0 1; do
  timeout 90 python3 bench/device/launch_ab.py engine.kernels.gemv.TOKEN_AHEAD=$a engine.kernels.gemv.GEMV_AHEAD=$a \
    -- -m bench.device.pdl_chain --json "$OUT/chain-ahead$a.json" --tokens 1 8 --fp8 2>&1 | grep -v -i warn \
    | python3 -c "import sys,json
for l in sys.stdin:
    if l.startswith('{'): r=json.loads(l); print('ahead $a', r['fp8'], r['tokens'], r['pdl'], r['us'], r['equal_to_off'])
    else: print(l.rstrip())"
done
python3 .gpu/model_shapes.py qwen3-8b /tmp/shapes/qwen3-8b --tokenizer .gpu/smollm2 >/dev/null
run() {  # name ahead args...
  local name=$1 a=$2
  shift 2
  timeout ${ENGINE_S:-75} python3 bench/device/launch_ab.py engine.kernels.gemv.TOKEN_AHEAD=$a \
    engine.kernels.gemv.GEMV_AHEAD=$a -- --model /tmp/shapes/qwen3-8b --load-format dummy --device cuda --runs 3 \
    --no-reference --prompt-len 512 --new-tokens 64 --batch-sizes 1 --json "$OUT/$name.json" "$@" 2>&1 \
    | grep -v -i warn > "$OUT/$name.log"
  grep -E "^ +[0-9]+ \|" "$OUT/$name.log" | head -3
}
for a in 1 0; do
  run qwen3-8b-bf16-ahead$a $a
  run qwen3-8b-fp8-ahead$a $a --quantization fp8
done
ENGINE_GEMV_TILES="$OUT/token-tiles.json" run qwen3-8b-fp8-ahead1-swept 1 --quantization fp8
decode_figures
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json ./*.txt && rm -f ./*.log ./*.json ./*.txt)

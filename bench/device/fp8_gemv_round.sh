# GPU run (issue #29, FP8 weights): the skinny matmul's tiles swept with weights streamed from HBM
# (bench/device/fp8_tune.py --only gemv), then bench.engine.throughput on qwen3-8b, bf16 against FP8 weights at batch 1/64,
# with the tiles the sweep chose (ENGINE_GEMV_TILES over engine/kernels/gemv_tiles.json).
# `bash bench/device/fp8_gemv_round.sh`; carries .whl and .gpu (setup.sh).
source bench/device/setup.sh
ENGINE_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider tests/engine/test_kernels.py -k skinny \
  2>&1 | tail -3 || true
timeout ${TUNE_S:-260} python3 bench/device/fp8_tune.py --only gemv --seconds ${PART_S:-200} --kinds ${KINDS:-bf16,fp8,fp8act} \
  --json "$OUT/fp8-tune-gemv.json" --tiles "$OUT/gemv-tiles.json" 2>&1 | grep -v -i warn | grep "^gemv" || true
cat "$OUT/gemv-tiles.json" || true
python3 .gpu/model_shapes.py qwen3-8b /tmp/shapes/qwen3-8b --tokenizer .gpu/smollm2 >/dev/null
for q in ${QUANTS:-none fp8}; do
  ENGINE_GEMV_TILES="$OUT/gemv-tiles.json" timeout 60 python3 -m bench.engine.throughput --model /tmp/shapes/qwen3-8b \
    --device cuda --prompt-len 512 --new-tokens 64 --batch-sizes 1 64 --runs 2 --no-reference \
    $([ $q = fp8 ] && echo --quantization fp8) --json "$OUT/qwen3-8b-w$q-tuned.json" 2>&1 | grep -v -i warn | tail -3 || true
done

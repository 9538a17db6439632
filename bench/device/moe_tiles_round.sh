# GPU run (issue #29): the fused MoE's decode tiles swept per GEMM (bench/device/moe_tiles.py, Qwen3-30B-A3B's
# shapes), then bench.engine.throughput on qwen3-30b-a3b (random weights, --load-format dummy) at batch 1 with the
# default tiles and with the sweep's (ENGINE_MOE_TILES). `bash bench/device/moe_tiles_round.sh`; carries .whl and
# .gpu. About 7 minutes.
source bench/device/setup.sh
ENGINE_TEST_DEVICE=cuda ENGINE_TEST_DTYPE=bfloat16 timeout 100 python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_moe.py 2>&1 | tee "$OUT/cuda-tests-moe.txt" | tail -3 || true
timeout $(( ${SWEEP_S:-120} + 80 )) python3 bench/device/moe_tiles.py --json "$OUT/moe-tiles.json" \
  --tiles "$OUT/moe-tiles-table.json" --seconds ${SWEEP_S:-120} 2>&1 | grep -v -i warn || true
cat "$OUT/moe-tiles-table.json" || true
python3 bench/device/shape_config.py qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b
for t in default swept; do
  (
    [ $t = swept ] && export ENGINE_MOE_TILES=$OUT/moe-tiles-table.json
    ENGINE_S=${ENGINE_S:-110} engine_bench qwen3-30b-a3b-b1-moe-$t /tmp/shapes/qwen3-30b-a3b --prompt-len 512 \
      --new-tokens 64 --batch-sizes 1 --runs 3 | grep -E "engine batch" || true
  )
done
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)

# GPU run (issue #29): the parts round's follow-up. parts_round.sh found the o projection in parts faster with PDL
# off and slower with it on; here, qwen3-30b-a3b at batch 1, PDL on: without parts, parts letting the next kernel in
# after their loop (PARTS_TRIGGER=2), and both with the o projection's tile on 2 pipeline stages (less shared memory a
# program) through ENGINE_GEMV_TILES. `bash bench/device/parts_trigger_round.sh`; carries .whl and .gpu. ~4 minutes.
source bench/device/setup.sh
set +e
python3 bench/device/shape_config.py qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b
echo '{"NVIDIA H200": {"bf16": {"2048x4096": [32, 512, 4, 2]}}}' > /tmp/o-stages2.json
run() {  # name max_parts trigger
  ab_bench "$1" /tmp/shapes/qwen3-30b-a3b engine.kernels.gemv.MAX_PARTS=$2 engine.kernels.gemv.PARTS_TRIGGER=$3 -- \
    --runs 3 --new-tokens 64 --batch-sizes 1
}
run qwen3-30b-a3b-b1-noparts 1 1
run qwen3-30b-a3b-b1-parts-loop 4 2
ENGINE_GEMV_TILES=/tmp/o-stages2.json run qwen3-30b-a3b-b1-parts-early-s2 4 1
ENGINE_GEMV_TILES=/tmp/o-stages2.json run qwen3-30b-a3b-b1-parts-loop-s2 4 2
ENGINE_GEMV_TILES=/tmp/o-stages2.json run qwen3-30b-a3b-b1-noparts-s2 1 1
decode_figures
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json && rm -f ./*.log ./*.json)

# GPU run (issue #29): programmatic dependent launch as the engine now picks it per kernel (on by default on Hopper;
# ENGINE_PDL=0 turns it off). The chain of Qwen3-8B's linear layers off / on (bench/device/pdl_chain.py), the CUDA
# tests of the kernels, MoE, FP8, core and async scheduling with PDL on, then bench.engine.throughput at batch 1
# (random weights, --load-format dummy): qwen3-8b bf16 off / on, FP8 on, qwen3-30b-a3b on.
# `bash bench/device/pdl_final_round.sh`; carries .whl and .gpu. About 8 minutes.
source bench/device/setup.sh
t0=$(date +%s)
timeout 120 python3 bench/device/pdl_chain.py --json "$OUT/pdl-chain-final.json" --fp8 2>&1 | grep -v -i warn || true
ENGINE_TEST_DEVICE=cuda ENGINE_TEST_DTYPE=bfloat16 timeout 230 python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_kernels.py tests/engine/test_moe.py tests/engine/test_fp8.py tests/engine/test_engine_core.py \
  tests/engine/test_async_scheduling.py 2>&1 | tee "$OUT/cuda-tests-pdl-final.txt" | tail -4 || true
for shape in qwen3-8b qwen3-30b-a3b; do python3 bench/device/shape_config.py $shape /tmp/shapes/$shape; done
run() {  # run NAME SHAPE PDL ARGS...
  local name=$1 shape=$2 pdl=$3
  shift 3
  [ $(( $(date +%s) - t0 )) -gt ${BUDGET_S:-520} ] && { echo "skipped $name: out of time"; return; }
  ENGINE_PDL=$pdl ENGINE_S=${ENGINE_S:-80} engine_bench $name /tmp/shapes/$shape --prompt-len 512 --new-tokens 64 \
    --runs 3 "$@" | grep -E "engine batch" || true
}
run qwen3-8b-b1-on qwen3-8b "" --batch-sizes 1
run qwen3-8b-b1-fp8-on qwen3-8b "" --batch-sizes 1 --quantization fp8
run qwen3-8b-b1-off qwen3-8b 0 --batch-sizes 1
run qwen3-30b-a3b-b1-on qwen3-30b-a3b "" --batch-sizes 1
decode_figures
(cd "$OUT" && tar czf logs.tgz ./*.log ./qwen3-*.json && rm -f ./*.log ./qwen3-*.json)

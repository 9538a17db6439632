# GPU run (issue #29): batch-1 decode after the MoE layers' three launches fewer, routing in one reduction a pick,
# and RoPE + KV store spread over a program per (token, KV head) at up to 16 tokens, against the code before
# (`git archive ca76503 engine bench | tar -x -C .old`, carried) in the same call: qwen3-30b-a3b at batch 1 and 64,
# qwen3-8b and SmolLM2 at batch 1; each prints its own figures (prompt 512, 64 new tokens, median of 3 runs).
# 1. the CUDA tests of the kernels touched. `bash bench/device/b1_launches_round.sh`; carries .whl, .gpu and .old.
source bench/device/setup.sh
ENGINE_TEST_DEVICE=cuda ENGINE_TEST_DTYPE=bfloat16 timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_moe.py tests/engine/test_kernels.py tests/engine/test_pdl.py -k "moe or route or norm or rope or famil or graph or pdl or wait or launch" \
  --deselect tests/engine/test_kernels.py::test_sampler_features_on_the_kernels_and_graphs \
  2>&1 | tee "$OUT/cuda-tests-b1-launches.txt" | tail -3 || true
for s in qwen3-30b-a3b qwen3-8b; do python3 bench/device/shape_config.py $s /tmp/shapes/$s; done
b1() {  # name model batches...
  local name=$1 model=$2
  shift 2
  ENGINE_S=150 engine_bench "$name" "$model" --prompt-len 512 --new-tokens 64 --runs 3 --batch-sizes "$@"
}
b1 qwen3-30b-a3b-now /tmp/shapes/qwen3-30b-a3b 1 64
(cd .old && PYTHONPATH=/tmp/site:$PWD b1 qwen3-30b-a3b-before /tmp/shapes/qwen3-30b-a3b 1 64)
b1 qwen3-8b-now /tmp/shapes/qwen3-8b 1
(cd .old && PYTHONPATH=/tmp/site:$PWD b1 qwen3-8b-before /tmp/shapes/qwen3-8b 1)
b1 smollm2-now "$MODEL" 1
(cd .old && PYTHONPATH=/tmp/site:$PWD b1 smollm2-before "$MODEL" 1)
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(f"{sys.argv[1]}/*-now.json") + glob.glob(f"{sys.argv[1]}/*-before.json")):
    for b, r in json.load(open(f))["batches"].items():
        print(f.rsplit("/", 1)[1], b, round(r["engine"]["decode_tok_s"], 1))
PY
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)

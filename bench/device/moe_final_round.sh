# GPU run (issue #29): the final code of the MoE decode changes (three launches fewer a layer at up to 16 tokens,
# routing in one reduction a pick on four warps, RoPE + KV store a program per (token, KV head), the block-expert
# table in tiles of the blocks there are) against the code before (`git archive ca76503 engine bench | tar -x -C .old`,
# carried), qwen3-30b-a3b at batch 1 and 64; the CUDA tests of the kernels touched; a batch-1 step by kernel, PDL off.
# `bash bench/device/moe_final_round.sh`; carries .whl, .gpu and .old.
source bench/device/setup.sh
ENGINE_TEST_DEVICE=cuda ENGINE_TEST_DTYPE=bfloat16 timeout ${TESTS_S:-100} python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_moe.py tests/engine/test_pdl.py tests/engine/test_kernels.py -k "moe or route or norm or rope or famil or pdl or wait or launch" \
  2>&1 | tee "$OUT/cuda-tests-moe-final.txt" | tail -3 || true
python3 bench/device/shape_config.py qwen3-30b-a3b /tmp/shapes/qwen3-30b-a3b
run() {  # name batches...
  local name=$1
  shift
  ENGINE_S=120 engine_bench "$name" /tmp/shapes/qwen3-30b-a3b --prompt-len 512 --new-tokens 64 --runs 3 --batch-sizes "$@"
}
run qwen3-30b-a3b-final 1 64
(cd .old && PYTHONPATH=/tmp/site:$PWD run qwen3-30b-a3b-before 1 64)
run qwen3-30b-a3b-final-again 1
ENGINE_S=100 ENGINE_PDL=0 engine_bench qwen3-30b-a3b-final-nopdl-profile /tmp/shapes/qwen3-30b-a3b --prompt-len 512 \
  --new-tokens 32 --batch-sizes 1 --profile | grep -E "route|rope|norm|gemm|gemv|attention|merge|decode step"
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)

# GPU run (issue #29): the engine's CUDA tests with programmatic dependent launch as the engine now runs it (on by
# default on Hopper, steps of at most 16 tokens, attention's trigger after its loop), which the tenth round's last
# call could not finish: kernels, MoE, FP8, core, scheduling ahead, speculative decoding, block manager, P/D overlap.
# `test_sampler_features_on_the_kernels_and_graphs` needs xgrammar, which the GPU machine's wheels lack.
# `bash bench/device/pdl_tests_round.sh`; carries .whl and .gpu. About 5 minutes.
source bench/device/setup.sh
ENGINE_TEST_DEVICE=cuda ENGINE_TEST_DTYPE=bfloat16 timeout 420 python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_kernels.py tests/engine/test_moe.py tests/engine/test_fp8.py tests/engine/test_engine_core.py \
  tests/engine/test_async_scheduling.py tests/engine/test_spec_decode_kernels.py tests/engine/test_engine_block_manager.py \
  tests/engine/test_pdl.py \
  --deselect tests/engine/test_kernels.py::test_sampler_features_on_the_kernels_and_graphs \
  2>&1 | tee "$OUT/cuda-tests-pdl.txt" | tail -4 || true

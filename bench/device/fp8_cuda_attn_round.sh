# GPU run (issue #29, FP8 KV at 1.3x bf16 KV): the CUDA C++ FP8 decode-attention kernel (engine/kernels/fp8_decode.cu).
# 1. its CUDA tests and the kernel tests around it; 2. alone against the Triton kernel (bench/device/fp8_mma_attn.py);
# 3. the engine's decode step of 256 sequences at 2K context: bf16 KV, FP8 KV on the CUDA kernel (kv_dtype_ab.sh), and
# FP8 KV on the Triton kernel (ENGINE_FP8_ATTENTION=triton). Clocks logged (clocks.csv).
# `bash bench/device/fp8_cuda_attn_round.sh`; carries .whl and .gpu. About 7 minutes. JSON and logs under $OUT.
source bench/device/setup.sh
log_clocks 250
[ -n "${SKIP_TESTS:-}" ] || ENGINE_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_kernels.py \
  -k "(cuda_fp8 or split or paged or fp8 or graph) and not sampler" 2>&1 | tail -4 | tee "$OUT/cuda-tests.txt" || true
timeout 120 python3 bench/device/fp8_mma_attn.py --cases "64x544,16x8K,256x2K,256x2K ragged" \
  --json "$OUT/fp8-mma-attn.json" 2>&1 | grep -v -i warn | cut -c1-400
ENGINE_S=${ENGINE_S:-100} source bench/device/kv_dtype_ab.sh
ENGINE_FP8_ATTENTION=triton ENGINE_S=${ENGINE_S:-100} engine_bench qwen3-8b-kvfp8-triton /tmp/shapes/qwen3-8b \
  --prompt-len 2048 --batch-sizes 256 --max-num-batched-tokens 16384 --kv-cache-dtype fp8 --new-tokens 8 --profile \
  --profile-batch 256 >/dev/null
python3 - "$OUT" <<'PY'
import json, sys
steps = {}
for kv in ("auto", "fp8", "fp8-triton"):
    try:
        steps[kv] = json.load(open(f"{sys.argv[1]}/qwen3-8b-kv{kv}.json"))["step_profile_us"]["execute_gpu_us"]
    except (OSError, KeyError, TypeError) as e:
        print(kv, "missing:", e)
print("GPU time of a step (us):", steps)
if "auto" in steps:
    print({k: round(steps["auto"] / v, 3) for k, v in steps.items()}, "(bf16 over each)")
PY
kill $CLOCKS || true
(cd "$OUT" && tar czf logs.tgz ./*.log ./clocks.csv && rm -f ./*.log ./clocks.csv)
ls "$OUT"

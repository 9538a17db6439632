# GPU run (issue #29): the engine with the decode-attention rule measured by attn_splits_round.sh (splits that fill
# one wave: engine.kernels.decode_splits; tiles: triton_ops.decode_tile). qwen3-8b (random weights, --load-format
# dummy): the GPU time of one decode step of 256 sequences at 2K context (--profile --profile-batch 256), bf16
# against FP8 KV; then prompt 512 at batch 1 and 64 (bf16). `bash bench/device/attn_engine_round.sh`; carries .whl
# and .gpu. About 5 minutes (SKIP_B64=1: the batch-256 pair alone). JSON and logs under $OUT.
source bench/device/setup.sh
source bench/device/kv_dtype_ab.sh
[ -n "${SKIP_B64:-}" ] || engine_bench qwen3-8b-b1-b64 /tmp/shapes/qwen3-8b --prompt-len 512 --new-tokens 32 \
  --batch-sizes 1 64

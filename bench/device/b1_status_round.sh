# GPU run (issue #29): where batch 1 stands on qwen3-8b (random weights, --load-format dummy, prompt 512, 64 new
# tokens), bf16 weights against FP8 weights in one call, each step profiled (host and GPU time, by kernel).
# `bash bench/device/b1_status_round.sh`; carries .whl and .gpu. About 4 minutes. JSON and logs under $OUT.
source bench/device/setup.sh
python3 bench/device/shape_config.py qwen3-8b /tmp/shapes/qwen3-8b
for q in bf16 fp8; do
  ENGINE_S=${ENGINE_S:-100} engine_bench qwen3-8b-b1-w$q /tmp/shapes/qwen3-8b --prompt-len 512 --new-tokens 64 \
    --batch-sizes 1 --profile $([ $q = fp8 ] && echo --quantization fp8) \
    | grep -E "engine batch|decode step|_gemv|_paged|_merge" || true
done
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)

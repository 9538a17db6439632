# GPU run (issue #29): where a batch-1 decode step goes, kernel by kernel (engine.bench --profile), on the
# qwen3-8b and qwen3-30b-a3b shapes (random weights drawn on the device, --load-format dummy).
# `bash bench/device/profile_b1.sh`; carries .whl and .gpu (setup.sh).
source bench/device/setup.sh
config_only() {  # config.json + tokenizer of a model_shapes.py shape, no weights
  python3 - "$1" "$2" <<'PY'
import json, os, shutil, sys
sys.path.insert(0, ".gpu"); import model_shapes as m
shape, out = sys.argv[1], sys.argv[2]; os.makedirs(out, exist_ok=True)
json.dump({**m.COMMON, **m.SHAPES[shape]}, open(os.path.join(out, "config.json"), "w"))
for f in os.listdir(".gpu/smollm2"):
    if f.startswith("tokenizer") or f.endswith(".jinja"): shutil.copy(os.path.join(".gpu/smollm2", f), out)
PY
}
for shape in ${SHAPES:-qwen3-8b qwen3-30b-a3b}; do
  config_only $shape /tmp/shapes/$shape
  timeout ${BENCH_S:-100} python3 -m engine.bench --model /tmp/shapes/$shape --load-format dummy --device cuda \
    --prompt-len 512 --new-tokens 32 --batch-sizes 1 64 --runs 1 --no-reference --profile \
    --json "$OUT/$shape-profile.json" 2>&1 | grep -v -i warn | tail -34 || true
done

# GPU run (issue #29, speed, fused decode round): fewer kernels per layer for steps of at most 16 tokens (RMSNorm in the
# skinny matmul's prologue, the MoE router's projection with it, MoE routing + alignment in one launch). Runs the CUDA
# kernel tests, then bench.engine.throughput on qwen3-8b and qwen3-30b-a3b (random weights drawn on the device,
# --load-format dummy) at batch 1 and 64 with the fusions off (ENGINE_FUSED_DECODE=0) and on, in the same call;
# last, a sweep of the MoE grouped GEMMs' decode tiles (bench/device/moe_tiles.py) for the next round.
# `bash bench/device/fuse_round.sh`; carries .whl and .gpu (setup.sh). At most 8 minutes on an H200 (the timeouts).
source bench/device/setup.sh
set +e  # one failing step must not hide the figures of the others
ENGINE_TEST_DEVICE=cuda timeout 140 python3 -m pytest -q -p no:cacheprovider \
  tests/engine/test_fused_decode.py tests/engine/test_kernels.py tests/engine/test_moe.py 2>&1 \
  | tee "$OUT/cuda-tests.txt" | tail -4
for shape in qwen3-8b qwen3-30b-a3b; do
  python3 bench/device/shape_config.py $shape /tmp/shapes/$shape
  for fused in 0 1; do
    ENGINE_FUSED_DECODE=$fused timeout 62 python3 -m bench.engine.throughput --model /tmp/shapes/$shape \
      --load-format dummy --device cuda --prompt-len 512 --new-tokens 64 --batch-sizes 1 64 --runs 2 --no-reference \
      --json "$OUT/$shape-fused$fused.json" 2>&1 | grep -v -i warn | tail -3
  done
done
python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
# Decode tok/s and share of the roofline, fusions off and on, and the ratio on / off.
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for shape in ("qwen3-8b", "qwen3-30b-a3b"):
    runs = {f: json.loads(p.read_text()) for f in (0, 1) if (p := out / f"{shape}-fused{f}.json").exists()}
    for b in ("1", "64"):
        row = {}
        for f, r in runs.items():
            x = r["batches"][b]
            row[f] = (x["engine"]["decode_tok_s"], 100 * x["engine"]["decode_tok_s"] / x["decode_roofline_tok_s"])
        text = " | ".join(f"fused={f}: {t:.1f} tok/s ({pct:.1f}% of roofline)" for f, (t, pct) in row.items())
        ratio = f" | on/off {row[1][0] / row[0][0]:.3f}x" if len(row) == 2 else ""
        print(f"{shape} batch {b}: {text}{ratio}")
PY
timeout 45 python3 bench/device/moe_tiles.py --json "$OUT/moe-tiles.json" 2>&1 | grep -v -i warn | tail -4

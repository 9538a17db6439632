# GPU run (issue #29, FP8 weights at batch 1; docs/engine.md, twenty-third round): the rules' e4m3 tiles against
# others in the engine (token_gemv.E4M3_TILE, E4M3_SWIGLU_TILE: warps, rows a warp, chunks a row in flight), after
# the sixteenth round's sweep chose them alone. qwen3-8b with FP8 weights, random weights, prompt 512, 128 new tokens,
# each setting in its own process. `bash bench/device/e4m3_tiles_engine_round.sh`; carries .whl, .gpu.
source bench/device/setup.sh
K=engine.kernels.token_gemv
row() { shape_row "$1" qwen3-8b "${@:2}" -- --batch-sizes 1 --new-tokens 128 --quantization fp8; }
row defaults
row sw814 "$K.E4M3_SWIGLU_TILE=(8,1,4)"
row sw414 "$K.E4M3_SWIGLU_TILE=(4,1,4)"
row sw422 "$K.E4M3_SWIGLU_TILE=(4,2,2)"
row sw822 "$K.E4M3_SWIGLU_TILE=(8,2,2)"
row sw224 "$K.E4M3_SWIGLU_TILE=(2,2,4)"
row sw418 "$K.E4M3_SWIGLU_TILE=(4,1,8)"
row t414 "$K.E4M3_TILE=(4,1,4)"
row t1614 "$K.E4M3_TILE=(16,1,4)"
row t824 "$K.E4M3_TILE=(8,2,4)"
row t812 "$K.E4M3_TILE=(8,1,2)"
row t811 "$K.E4M3_TILE=(8,1,1)"
row defaults2
(cd "$OUT" && tar rf runs.tar ./*.log ./*.json && rm -f ./*.log ./*.json) 2>/dev/null || true

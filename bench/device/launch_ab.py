"""bench.engine.throughput with module constants of the engine's kernels set first (an A/B within one GPU call).

python3 bench/device/launch_ab.py engine.kernels.triton_ops.ROPE_GROUPS_TOKENS=0 -- --model ... (throughput's args)
"""

import importlib
import runpy
import sys

split = sys.argv.index("--")
for assignment in sys.argv[1:split]:
    target, value = assignment.split("=", 1)
    module, name = target.rsplit(".", 1)
    setattr(importlib.import_module(module), name, int(value))
    print(f"set {target} = {value}", flush=True)
sys.argv = ["bench.engine.throughput", *sys.argv[split + 1 :]]
runpy.run_module("bench.engine.throughput", run_name="__main__")

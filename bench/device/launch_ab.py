"""bench.engine.throughput, or another module, with module constants of the engine's kernels set first (an A/B
within one GPU call).

python3 bench/device/launch_ab.py engine.kernels.triton_ops.ROPE_GROUPS_TOKENS=0 -- --model ... (throughput's args)
python3 bench/device/launch_ab.py engine.kernels.gemv.MAX_PARTS=1 -- -m bench.device.pdl_chain --json ... --fp8
"""

import ast
import importlib
import runpy
import sys

split = sys.argv.index("--")
for assignment in sys.argv[1:split]:
    target, value = assignment.split("=", 1)
    module, name = target.rsplit(".", 1)
    if not hasattr(importlib.import_module(module), name):  # a misspelt or removed knob would time the default
        sys.exit(f"launch_ab: {module} has no constant {name}")
    setattr(importlib.import_module(module), name, ast.literal_eval(value))  # an int, tuple or dict
    print(f"set {target} = {value}", flush=True)
rest = sys.argv[split + 1 :]
module = "bench.engine.throughput"
if rest[:1] == ["-m"]:
    module, rest = rest[1], rest[2:]
sys.argv = [module, *rest]
runpy.run_module(module, run_name="__main__")

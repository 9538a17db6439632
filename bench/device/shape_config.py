"""A model_shapes.py shape as a checkpoint folder without weights (config.json and SmolLM2's tokenizer files),
for engines started with --load-format dummy on the GPU machine.

    python3 bench/device/shape_config.py SHAPE DIR
"""

import json
import os
import shutil
import sys

sys.path.insert(0, ".gpu")
import model_shapes as m  # carried in .gpu, beside no package

shape, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "config.json"), "w") as f:
    json.dump({**m.COMMON, **m.SHAPES[shape]}, f)
for name in os.listdir(".gpu/smollm2"):
    if name.startswith("tokenizer") or name.endswith(".jinja"):
        shutil.copy(os.path.join(".gpu/smollm2", name), out)

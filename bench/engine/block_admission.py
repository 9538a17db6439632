"""What admitting a long prompt costs the block manager: allocate + free of an 8K-token prompt.

The engine admits on the event loop, so every millisecond here is a millisecond no stream is served.
One round is a new request's whole block-manager life: ``can_allocate`` and ``allocate`` (as the
scheduler admits it), ``mark_computed`` (its prefill wrote the KV), then ``deallocate``. Two cases:
``miss``, a prompt never seen (every block hashed, indexed and freed; the pool is four prompts deep,
so every block taken also drops an older prefix), and ``hit``, the same prompt again (every full block
found in the prefix cache). The peer is the floor measured in the same run: hashing the prompt's
blocks once (``engine.block_manager.chain_hashes`` over the blocks' token tuples), which any prefix
cache keyed by block hashes has to do. ``--before FILE`` also runs another version of
``engine/block_manager.py`` (e.g. from ``git show REV:engine/block_manager.py``), its rounds
interleaved with this tree's, so both see the same load.

    python -m bench.engine.block_admission [--tokens 8192] [--rounds 200] [--before FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

from engine import block_manager
from engine.block_manager import chain_hashes
from engine.sequence import SamplingParams, Sequence

TARGET_MS = 1.0


def load_version(path: Path) -> ModuleType:
    """Another ``engine/block_manager.py``, imported under its own name beside this tree's."""
    spec = importlib.util.spec_from_file_location("block_manager_before", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--before: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.engine.block_admission", description=__doc__.split("\n", 1)[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--before", type=Path, default=None, help="another engine/block_manager.py to run beside this one")
    args = ap.parse_args()
    bs, n = args.block_size, args.tokens
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1)
    ids = iter(range(1, 1 << 30))
    versions: dict[str, Any] = {"this tree": block_manager}
    if args.before is not None:
        versions = {"before": load_version(args.before), **versions}
    managers = {name: module.BlockManager(4 * (n // bs + 1), bs) for name, module in versions.items()}

    def admit(manager: Any, prompt: list[int]) -> None:
        seq = Sequence(next(ids), prompt, params, bs)
        assert manager.can_allocate(seq)
        manager.allocate(seq)
        manager.mark_computed(seq, len(seq))
        manager.deallocate(seq)

    def miss(manager: Any, prompts: Iterator[list[int]]) -> None:
        admit(manager, next(prompts))

    fresh = [[rng.randrange(49152) for _ in range(n)] for _ in range(args.rounds)]
    same = [rng.randrange(49152) for _ in range(n)]
    for manager in managers.values():
        admit(manager, same)

    def floor() -> None:  # the hashes' definition, once: the blocks' token tuples, chained
        chain_hashes([tuple(same[i : i + bs]) for i in range(0, n - n % bs, bs)], None)

    cases: dict[str, Callable[[], None]] = {}
    for name, manager in managers.items():
        cases[f"miss, {name}"] = partial(miss, manager, iter(fresh))  # every version sees the same prompts
        cases[f"hit, {name}"] = partial(admit, manager, same)
    cases["hash once (floor)"] = floor
    times: dict[str, list[float]] = {case: [] for case in cases}
    for _ in range(args.rounds):  # one round of every case at a time: a change of load hits them alike
        for case, fn in cases.items():
            start = time.process_time()  # CPU time: a loaded machine's waits for a core are not counted
            fn()
            times[case].append(time.process_time() - start)
    medians = {case: statistics.median(t) * 1e3 for case, t in times.items()}
    base = medians["hash once (floor)"]
    print(f"block manager, one {n}-token prompt (block size {bs}), median CPU time of {args.rounds} rounds")
    print(f"{'case':<24}{'ms':>8}{'x floor':>10}{'x target':>10}")
    for case, ms in medians.items():
        print(f"{case:<24}{ms:>8.3f}{ms / base:>10.2f}{ms / TARGET_MS:>10.2f}")
    if "before" in versions:
        for kind in ("miss", "hit"):
            print(f"{kind}: this tree / before = {medians[f'{kind}, this tree'] / medians[f'{kind}, before']:.2f}")


if __name__ == "__main__":
    main()

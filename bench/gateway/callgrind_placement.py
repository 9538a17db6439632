"""Instructions per `Placement.place` + `release`, per policy, counted by callgrind (load-independent).

Wall-clock timings on a shared machine drift by more than the changes worth measuring; instruction
counts do not. Each phase runs 32 requests in flight over 16 workers (1 KB prompts: one of 16 shared
768-byte prefixes + a unique tail), after a warm-up pass, between two `os.getppid()` calls, which
callgrind is told to dump before. Compare two trees by running this once with each on PYTHONPATH:

    PYTHONHASHSEED=0 PYTHONPATH=TREE valgrind --tool=callgrind --dump-before=getppid \\
        --callgrind-out-file=/tmp/cg.out python bench/gateway/callgrind_placement.py 2000
    python bench/gateway/callgrind_placement.py --report /tmp/cg.out 2000

Dump 1 is start-up and warm-up; dumps 2.. are the phases in PHASES order.
"""

from __future__ import annotations

import glob
import os
import random
import sys
from collections import deque

PHASES = (
    "random",
    "round_robin",
    "power_of_two",
    "least_load",
    "prefix_hash",
    "cache_aware",
    "pd cache_aware/least_load",
    "pd cache_aware/cache_aware",
    "pd round_robin/round_robin",
)


def report(prefix: str, n: int) -> None:
    files = sorted(glob.glob(prefix + ".*"), key=lambda f: int(f.rsplit(".", 1)[1]))
    for name, f in zip(("start-up", *PHASES), files, strict=False):
        with open(f) as fh:
            total = next(int(line.split()[1]) for line in fh if line.startswith(("summary:", "totals:")))
        print(f"{name:<28}{total / (1 if name == 'start-up' else n):>14,.0f}")


def main(n: int) -> None:
    from atomesh.config import GatewayConfig
    from atomesh.placement import Placement, Plan
    from atomesh.policies import make_policy
    from atomesh.request import RequestView, Route
    from atomesh.workers.registry import WorkerRegistry
    from atomesh.workers.worker import Worker, WorkerRole, WorkerState

    rng = random.Random(0)
    shared = ["".join(rng.choice("abcdefgh ") for _ in range(768)) for _ in range(16)]
    prompts = [rng.choice(shared) + "".join(rng.choice("abcdefgh ") for _ in range(256)) for _ in range(256)]
    views = [RequestView(Route.COMPLETIONS, {"prompt": p}, b"", "r") for p in prompts]
    cfg = GatewayConfig.model_validate({})

    def make(spec: str) -> Placement:
        names = spec.removeprefix("pd ").split("/")
        pd = spec.startswith("pd ")
        roles = (WorkerRole.PREFILL, WorkerRole.DECODE) if pd else (WorkerRole.REGULAR,)
        registry = WorkerRegistry()
        for role in roles:
            for i in range(16):
                w = Worker(f"http://{role.value}-{i}:8000", role)
                registry.add(w)
                registry.set_state(w, WorkerState.READY)
        # Names as strings: this also runs on trees from before config.PolicyName (a StrEnum).
        policies = {r: make_policy(names[k], cfg) for k, r in enumerate(roles)}  # type: ignore[arg-type]
        return Placement(registry, policies, pd=pd)

    def run(placement: Placement) -> None:
        inflight: deque[Plan] = deque()
        for k in range(n):
            inflight.append(placement.place(views[k % len(views)]))
            if len(inflight) > 32:
                placement.release(inflight.popleft())
        while inflight:
            placement.release(inflight.popleft())

    placements = [make(spec) for spec in PHASES]
    for p in placements:
        run(p)
    for p in placements:
        os.getppid()
        run(p)
    os.getppid()


if __name__ == "__main__":
    if sys.argv[1] == "--report":
        report(sys.argv[2], int(sys.argv[3]))
    else:
        main(int(sys.argv[1]))

"""What admitting a long prompt costs the block manager: allocate + free of an 8K-token prompt.

The engine admits on the event loop, so every millisecond here is a millisecond no stream is served.
One round is a new request's whole block-manager life: ``can_allocate`` and ``allocate`` (as the
scheduler admits it), ``mark_computed`` (its prefill wrote the KV), then ``deallocate``. Two cases:
``miss``, a prompt never seen (every block hashed, indexed and freed), and ``hit``, the same prompt
again (every full block found in the prefix cache). The peer is the floor measured in the same run:
hashing the prompt's blocks once, which any prefix cache keyed by block hashes has to do.

    python -m bench.engine.block_admission [--tokens 8192] [--rounds 200]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from array import array
from collections.abc import Callable

import xxhash

from engine.block_manager import BlockManager
from engine.sequence import SamplingParams, Sequence

TARGET_MS = 1.0


def _median_ms(fn: Callable[[], None], rounds: int) -> float:
    """Median CPU time of ``fn`` (process time: a loaded machine's waits for a core are not counted)."""
    times = []
    for _ in range(rounds):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    bs, n = args.block_size, args.tokens
    rng = random.Random(0)
    manager = BlockManager(4 * (n // bs + 1), bs)
    params = SamplingParams(max_tokens=1)
    ids = iter(range(1, 1 << 30))

    def admit(prompt: list[int]) -> None:
        seq = Sequence(next(ids), prompt, params, bs)
        assert manager.can_allocate(seq)
        manager.allocate(seq)
        manager.mark_computed(seq, len(seq))
        manager.deallocate(seq)

    fresh = iter([[rng.randrange(49152) for _ in range(n)] for _ in range(args.rounds)])

    def miss() -> None:
        admit(next(fresh))

    same = [rng.randrange(49152) for _ in range(n)]
    admit(same)

    def hit() -> None:
        admit(same)

    def floor() -> None:  # the block hashes' definition, packed once: int64 tokens chained through the hashes
        packed, width, prev = array("q", same).tobytes(), 8 * bs, b""
        for offset in range(0, n // bs * width, width):
            prev = xxhash.xxh64_intdigest(prev + packed[offset : offset + width]).to_bytes(8, "little")

    results = {
        "miss": _median_ms(miss, args.rounds),
        "hit": _median_ms(hit, args.rounds),
        "hash once (floor)": _median_ms(floor, args.rounds),
    }
    base = results["hash once (floor)"]
    print(f"block manager, one {n}-token prompt (block size {bs}), median CPU time of {args.rounds} rounds")
    print(f"{'case':<20}{'ms':>8}{'x floor':>10}{'x target':>10}")
    for name, ms in results.items():
        print(f"{name:<20}{ms:>8.3f}{ms / base:>10.2f}{ms / TARGET_MS:>10.2f}")


if __name__ == "__main__":
    main()

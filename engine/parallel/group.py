"""The tensor-parallel group one rank belongs to, and the collectives the model calls.

One engine with ``--tensor-parallel-size N`` runs N processes; each holds a 1/N slice of every
column- or row-split weight and of the KV heads, and the ranks meet in four places per step:
after each O and down projection (all-reduce), in the vocab-parallel embedding (all-reduce), in the
LM head (all-gather of the vocabulary slices) and, with sparse attention, over the block scores.
NCCL on CUDA, gloo on CPU; the collectives are plain ``torch.distributed`` calls, which a CUDA graph
captures like any other kernel (NCCL) when every rank captures the same graph at the same time.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

# How long a rank waits for the others in a collective or at start-up. A rank that died leaves its
# peers' sockets closed, which gloo notices at once; this bounds a peer that hangs.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


class TensorParallel:
    """This process's place in the tensor-parallel group: ``rank`` of ``size``, and whether MoE experts are
    split whole between the ranks (``--enable-expert-parallel``) instead of each expert being column/row-split.

    ``size == 1`` (``SINGLE``) makes every collective the identity, so the model code has one path.
    """

    def __init__(self, rank: int = 0, size: int = 1, expert_parallel: bool = False,
                 group: ProcessGroup | None = None) -> None:  # fmt: skip
        if not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} is not in 0..{size - 1}")
        if size > 1 and group is None:
            raise ValueError("a tensor-parallel group of more than one rank needs its process group")
        self.rank = rank
        self.size = size
        self.expert_parallel = expert_parallel and size > 1
        self.group = group

    def __repr__(self) -> str:
        return f"TensorParallel(rank={self.rank}, size={self.size}, expert_parallel={self.expert_parallel})"

    def split(self, total: int, what: str) -> int:
        """This rank's share of ``total`` (heads, rows, experts), which must divide evenly."""
        if total % self.size:
            raise ValueError(f"--tensor-parallel-size {self.size} does not divide {what} ({total})")
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks, in place (the partial outputs of a row-split projection)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` side by side along the last dimension, rank order (the vocabulary slices of the
        LM head's logits)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest ``value`` over the ranks (the KV block count every rank can hold)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


SINGLE = TensorParallel()


def join_group(rank: int, size: int, store_file: str, device: torch.device, expert_parallel: bool) -> TensorParallel:
    """Join the group of ``size`` ranks meeting at ``store_file`` (a file rendezvous: no port to collide on).

    Blocks until every rank has joined. NCCL for CUDA devices, gloo for the CPU.
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "gloo":
        # The ranks of one engine share a host: gloo over loopback, whatever the host name resolves to.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"file://{store_file}", rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT, **kwargs)  # type: ignore[arg-type]  # fmt: skip
    return TensorParallel(rank, size, expert_parallel, dist.group.WORLD)


def leave_group() -> None:
    """Destroy this process's group (on shutdown)."""
    if dist.is_initialized():
        dist.destroy_process_group()

"""CUDA graphs of the decode step: captured once per batch-size bucket, replayed every step.

A decode step of a small model is a few hundred tiny kernels; launched one by one from Python the
GPU waits on the host most of the time. Captured in a graph, the whole step (embedding, every
layer, the head and the greedy argmax) is one launch. The graphs read their inputs from static
buffers that ``stage`` fills: token ids, positions, KV slots, context lengths and block tables,
laid out in one pinned host buffer so a step's inputs cross to the GPU in a single copy. A batch
smaller than its bucket is padded with rows that read and write only the scratch block (the block
after the pool), so padding never touches a sequence's KV.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence as Seq

import torch

from engine.attention import AttentionMetadata
from engine.kernels import decode_splits
from engine.models.llama import LlamaForCausalLM
from engine.sequence import Sequence

log = logging.getLogger(__name__)


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to ``max_num_seqs`` (at most 512), as vLLM does."""
    top = min(max_num_seqs, 512)
    return [b for b in (1, 2, 4) if b <= top] + list(range(8, top + 1, 8))


class DecodeGraphs:
    """The captured decode graphs of one model runner and the static buffers they read."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        indexer_caches: list[torch.Tensor],
        sizes: list[int],
        block_size: int,
        scratch_block: int,
        max_model_len: int,
        sparse_topk: int,
    ) -> None:
        if not sizes or sizes[0] < 1:
            raise ValueError(f"capture sizes must be positive batch sizes, got {sizes}")
        self.model = model
        self.kv_caches = kv_caches
        self.indexer_caches = indexer_caches
        self.sizes = sizes
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.max_model_len = max_model_len
        self.sparse_topk = sparse_topk if indexer_caches else 0
        top = sizes[-1]
        self.width = -(-max_model_len // block_size)  # block-table columns: room for the longest context
        device = kv_caches[0].device
        # One buffer, five regions: ids, positions, slots, context lengths (top each), then the tables.
        n = 4 * top + top * self.width
        self._host = torch.zeros(n, dtype=torch.int32, pin_memory=True)
        self._dev = torch.zeros(n, dtype=torch.int32, device=device)
        h = self._host.numpy()
        self._ids, self._pos, self._slots, self._ctx = (h[i * top : (i + 1) * top] for i in range(4))
        self._tables = h[4 * top :].reshape(top, self.width)
        self._pad(0, top)
        self._dev.copy_(self._host)
        d = self._dev
        self._d_ids, self._d_pos, self._d_slots, self._d_ctx = (d[i * top : (i + 1) * top] for i in range(4))
        self._d_tables = d[4 * top :].view(top, self.width)
        self._d_query_start = torch.arange(top + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._staged = 0  # bucket of the staged step

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def _pad(self, start: int, end: int) -> None:
        # Padding rows: token 0 at position 0, written to and read from the scratch block.
        self._ids[start:end] = 0
        self._pos[start:end] = 0
        self._slots[start:end] = self.scratch_block * self.block_size
        self._ctx[start:end] = 1
        self._tables[start:end, 0] = self.scratch_block

    def _forward(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        meta = AttentionMetadata(
            num_decodes=batch,
            slot_mapping=self._d_slots[:batch],
            block_tables=self._d_tables[:batch],
            context_lens=self._d_ctx[:batch],
            query_lens=[1] * batch,
            cached_lens=[0] * batch,
            max_query_len=1,
            max_context=self.max_model_len,
            query_start=self._d_query_start[: batch + 1],
            num_splits=decode_splits(batch, self.model.config.num_key_value_heads, self.max_model_len,
                                     self._dev.device),
            sparse_topk=self.sparse_topk,
        )
        hidden = self.model(self._d_ids[:batch], self._d_pos[:batch], self.kv_caches, meta,
                            self.indexer_caches or None)  # fmt: skip
        logits = self.model.compute_logits(hidden)
        return logits, logits.argmax(dim=-1)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so that the smaller ones reuse its memory pool."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for batch in reversed(self.sizes):
            self._forward(batch)  # warm-up: compiles the kernels, settles cuBLAS's workspaces
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[batch] = self._forward(batch)
            self._graphs[batch] = graph
        torch.cuda.synchronize()
        log.info("captured %d decode CUDA graphs (batch %d..%d) in %.1f s", len(self.sizes), self.sizes[0],
                 self.sizes[-1], time.perf_counter() - start)  # fmt: skip

    def stage(self, seqs: Seq[Sequence]) -> None:
        """Write the decode inputs of ``seqs`` (at most the largest bucket) into the host buffer."""
        n = len(seqs)
        bucket = self.sizes[bisect.bisect_left(self.sizes, n)]
        bs = self.block_size
        for i, seq in enumerate(seqs):
            pos = len(seq) - 1
            table = seq.block_table
            self._ids[i] = seq.token_ids[pos]
            self._pos[i] = pos
            self._slots[i] = table[pos // bs] * bs + pos % bs
            self._ctx[i] = pos + 1
            self._tables[i, : len(table)] = table
        self._pad(n, bucket)
        self._staged = bucket

    def replay(self, num_seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the staged inputs over, run the bucket's graph; (logits, greedy tokens) of the real rows."""
        bucket = self._staged
        top = self.sizes[-1]
        used = 4 * top + bucket * self.width
        self._dev[:used].copy_(self._host[:used], non_blocking=True)
        self._graphs[bucket].replay()
        logits, tokens = self._outputs[bucket]
        return logits[:num_seqs], tokens[:num_seqs]


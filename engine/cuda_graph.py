"""CUDA graphs of the model step: captured once per batch-size bucket at start-up, replayed every step.

A step of a small model is a few hundred tiny kernels; launched one by one from Python the GPU
waits on the host most of the time (20 ms a step for SmolLM2). Captured in a graph, the whole step
(embedding, every layer, the head and the greedy argmax) is one launch. Two families share the
work:

- ``DecodeGraphs``: steps where every sequence decodes one token, one graph per batch size
  (1, 2, 4, 8, 16, ...); attention splits each context over several programs (flash-decoding).
- ``MixedGraphs``: steps with prompt tokens (a prefill, or prompt chunks mixed with decodes), one
  graph per token count (16, 32, ... up to the step's token budget). Attention runs one program per
  (sequence, query tile) through a map the host builds each step, so one graph serves any mix of
  sequences that fits its token count.

The graphs read their inputs from static buffers laid out in one pinned host buffer, so a step's
inputs cross to the GPU in a single copy. A batch smaller than its bucket is padded with tokens
that write only the scratch block (the block after the pool) and with sequences that own no query
tokens, so padding never touches a sequence's KV. Without CUDA (the Triton interpreter in tests)
the same buffers are used and the forward simply runs instead of a replay.
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.kernels import decode_splits, tile_capacity, tile_map
from engine.models.decoder import DecoderForCausalLM
from engine.sequence import Sequence

log = logging.getLogger(__name__)

# (logits [rows, vocab] float32, greedy tokens [rows], the target's hidden states an EAGLE-3 head reads: None
# without a head, else ``[tokens, 3 * hidden]``)
Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def forward_target(
    model: DecoderForCausalLM, ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
    meta: AttentionMetadata, indexer_caches: list[torch.Tensor] | None, aux_layers: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """The target's forward, as eager steps run it and the graphs capture it: hidden states after the final norm
    and, when ``aux_layers`` names some, the residual stream entering each of them side by side (``[tokens,
    len(aux_layers) * hidden]``, what an EAGLE-3 head's ``fc`` reads; captured, a static output buffer)."""
    aux: dict[int, torch.Tensor] | None = {} if aux_layers else None
    hidden = model(ids, positions, kv_caches, meta, indexer_caches or None, aux)
    if aux is None:
        return hidden, None
    return hidden, torch.cat([aux[i] for i in aux_layers], dim=-1)


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes: 1, 2, 4, then every multiple of 8 up to ``max_num_seqs`` (at most 512), as vLLM."""
    top = min(max_num_seqs, 512)
    return [b for b in (1, 2, 4) if b <= top] + list(range(8, top + 1, 8))


def default_token_sizes(max_num_batched_tokens: int) -> list[int]:
    """Token counts of the mixed-step graphs: powers of two from 16 up to the step's token budget."""
    sizes = [t for t in (1 << i for i in range(4, 15)) if t < max_num_batched_tokens]
    return [*sizes, min(max_num_batched_tokens, 16384)]


class _Buffers:
    """Named int32 regions of one pinned host buffer and its device mirror."""

    def __init__(self, regions: dict[str, int], device: torch.device) -> None:
        total = sum(regions.values())
        self.host = torch.zeros(total, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.dev = torch.zeros(total, dtype=torch.int32, device=device)
        self.offsets: dict[str, int] = {}
        self.np: dict[str, np.ndarray] = {}
        self.d: dict[str, torch.Tensor] = {}
        offset = 0
        host = self.host.numpy()
        for name, size in regions.items():
            self.offsets[name] = offset
            self.np[name] = host[offset : offset + size]
            self.d[name] = self.dev[offset : offset + size]
            offset += size

        self._copied: torch.cuda.Event | None = None

    def upload(self, end: int) -> None:
        """Copy the first ``end`` entries over (all a step wrote)."""
        self.dev[:end].copy_(self.host[:end], non_blocking=True)
        if self.dev.is_cuda:
            self._copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._copied.record()

    def writable(self) -> None:
        """Wait until the last upload has read the host buffer (a step that samples nothing never syncs)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None


class _GraphSet:
    """Graphs keyed by a size, captured largest first so the smaller ones reuse its memory pool."""

    def __init__(self, sizes: list[int], capture: bool) -> None:
        if not sizes or sizes[0] < 1:
            raise ValueError(f"graph sizes must be positive, got {sizes}")
        self.sizes = sizes
        self.capture_graphs = capture  # False: no CUDA (tests under the Triton interpreter)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, Outputs] = {}
        self._forwards: dict[int, Callable[[], Outputs]] = {}

    def bucket(self, n: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    @torch.inference_mode()
    def capture(self, forward: Callable[[int], Outputs], what: str) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if self.capture_graphs else None
        # A dead engine's graphs freed by the garbage collector mid-capture (cudaGraphExecDestroy while
        # a stream captures) would invalidate the capture: collect now, and not again until done.
        collecting = gc.isenabled()
        if self.capture_graphs:
            gc.collect()
            gc.disable()
        try:
            for size in reversed(self.sizes):
                self._forwards[size] = lambda size=size: forward(size)  # type: ignore[misc]
                if not self.capture_graphs:
                    continue
                forward(size)  # warm-up: compiles the kernels, settles cuBLAS's workspaces
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                # thread_local: CUDA work of other threads (a server's other engines, a KV relay's copies)
                # must not invalidate this thread's capture.
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    self._outputs[size] = forward(size)
                self._graphs[size] = graph
        finally:
            if collecting:
                gc.enable()
        if self.capture_graphs:
            torch.cuda.synchronize()
            log.info("cuda_graphs_captured kind=%s count=%d sizes=%d..%d secs=%.1f", what, len(self.sizes),
                     self.sizes[0], self.sizes[-1], time.perf_counter() - start)  # fmt: skip

    def run(self, size: int) -> Outputs:
        if not self.capture_graphs:
            return self._forwards[size]()
        self._graphs[size].replay()
        return self._outputs[size]


class _TableRows:
    """A graph's host block tables (one row per sequence seat), kept between steps: a row whose sequence comes back
    with the same list and table epoch (``Sequence.table_epoch``: bumped when a table shrinks or is freed) has only
    grown, so a step writes just its new entries. Another sequence in the row, a new list, a shrunk table or a row
    overwritten in between (``forget``) makes it copy the whole table. Copying every table afresh was most of a
    large batch's staging."""

    def __init__(self, tables: np.ndarray) -> None:
        self.tables = tables
        # Per row: (the block table list it copies, that sequence's table epoch, how many entries).
        self._rows: list[tuple[list[int], int, int] | None] = [None] * tables.shape[0]

    def write(self, seqs: Seq[Sequence]) -> None:
        """Rows ``0..len(seqs)`` hold ``seqs``' block tables (entries past a table's end are left as they were)."""
        tables, rows = self.tables, self._rows
        for i, seq in enumerate(seqs):
            table = seq.block_table
            row, epoch, end = rows[i] or (None, 0, 0)
            start = end if row is table and epoch == seq.table_epoch and end <= len(table) else 0
            if 0 < start == len(table):
                continue  # the same table, not grown since the last step
            tables[i, start : len(table)] = table[start:]
            rows[i] = (table, seq.table_epoch, len(table))

    def forget(self, start: int, end: int) -> None:
        """Rows ``start..end`` were written by other means (padding): the next ``write`` copies them whole."""
        self._rows[start:end] = [None] * (end - start)


class DecodeGraphs(_GraphSet):
    """The decode-step graphs of one model runner (every sequence computes one token)."""

    def __init__(
        self, model: DecoderForCausalLM, kv_caches: list[torch.Tensor], indexer_caches: list[torch.Tensor],
        sizes: list[int], block_size: int, scratch_block: int, max_model_len: int, sparse_topk: int,
    ) -> None:  # fmt: skip
        device = kv_caches[0].device
        super().__init__(sizes, capture=device.type == "cuda")
        self.model = model
        self.kv_caches = kv_caches
        self.indexer_caches = indexer_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.max_model_len = max_model_len
        self.sparse_topk = sparse_topk if indexer_caches else 0
        top = sizes[-1]
        self.width = -(-max_model_len // block_size)  # block-table columns: room for the longest context
        # feed: for a step scheduled ahead, the row of the step before whose sampled token is each row's input id
        self.buf = _Buffers({"ids": top, "pos": top, "slots": top, "ctx": top, "feed": top,
                             "tables": top * self.width}, device)  # fmt: skip
        self._tables = self.buf.np["tables"].reshape(top, self.width)
        self._d_tables = self.buf.d["tables"].view(top, self.width)
        self._d_query_start = torch.arange(top + 1, dtype=torch.int32, device=device)
        self._table_rows = _TableRows(self._tables)
        self._pad(0, top)
        self.buf.upload(self.buf.dev.numel())
        self._staged = 0

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def _pad(self, start: int, end: int) -> None:
        # Padding rows: token 0 at position 0, written to and read from the scratch block.
        b = self.buf.np
        b["ids"][start:end] = 0
        b["pos"][start:end] = 0
        b["slots"][start:end] = self.scratch_block * self.block_size
        b["ctx"][start:end] = 1
        self._tables[start:end, 0] = self.scratch_block
        self._table_rows.forget(start, end)

    def _forward(self, batch: int) -> Outputs:
        d = self.buf.d
        meta = AttentionMetadata(
            num_decodes=batch,
            slot_mapping=d["slots"][:batch],
            block_tables=self._d_tables[:batch],
            context_lens=d["ctx"][:batch],
            query_lens=[1] * batch,
            cached_lens=[0] * batch,
            max_query_len=1,
            max_context=self.max_model_len,
            query_start=self._d_query_start[: batch + 1],
            num_splits=decode_splits(
                batch,
                self.model.config.num_key_value_heads // self.model.tp.size,
                self.max_model_len,
                self.buf.dev.device,
                self.kv_caches[0].element_size() == 1,
            ),  # this rank's KV heads
            sparse_topk=self.sparse_topk,
        )
        hidden, _ = forward_target(self.model, d["ids"][:batch], d["pos"][:batch], self.kv_caches, meta,
                                   self.indexer_caches, ())  # fmt: skip
        logits = self.model.compute_logits(hidden)
        return logits, logits.argmax(dim=-1), None

    def capture_all(self) -> None:
        self.capture(self._forward, "decode")

    def stage(self, seqs: Seq[Sequence], feed: Seq[int] = ()) -> None:
        """Write the decode inputs of ``seqs`` (at most the largest bucket) into the host buffer. ``feed``: each
        sequence's row in the step before, whose token (still on the device) is its input id (``replay``)."""
        self.buf.writable()
        n = len(seqs)
        bucket = self.bucket(n)
        bs = self.block_size
        b = self.buf.np
        # Whole columns at once (a numpy element written one by one costs more than the list it comes from).
        positions = [len(seq.token_ids) - 1 for seq in seqs]
        b["ids"][:n] = [seq.token_ids[-1] for seq in seqs]
        b["pos"][:n] = positions
        b["ctx"][:n] = b["pos"][:n] + 1
        b["slots"][:n] = [seq.block_table[p // bs] * bs + p % bs for seq, p in zip(seqs, positions, strict=True)]
        if feed:
            b["feed"][:n] = feed
        self._table_rows.write(seqs)
        self._pad(n, bucket)
        self._staged = bucket

    def replay(self, num_seqs: int, fed: torch.Tensor | None = None) -> Outputs:
        """Copy the staged inputs over, run the bucket's graph; (logits, greedy tokens) of the real rows.
        ``fed``: the step before's sampled tokens on the device; row i's input id becomes ``fed[feed[i]]``."""
        bucket = self._staged
        self.buf.upload(self.buf.offsets["tables"] + bucket * self.width)
        if fed is not None:
            d = self.buf.d
            d["ids"][:num_seqs].copy_(fed.index_select(0, d["feed"][:num_seqs]))
        logits, tokens, _ = self.run(bucket)
        return logits[:num_seqs], tokens[:num_seqs], None


class MixedGraphs(_GraphSet):
    """Graphs of steps with prompt tokens or verify rows, one per token count; attention through a per-step tile
    map. With ``aux_layers`` (an EAGLE-3 head is attached) each graph also writes the target's hidden states at
    those layers for every token into a static buffer, which the head reads after the replay."""

    def __init__(
        self, model: DecoderForCausalLM, kv_caches: list[torch.Tensor], sizes: list[int], max_seqs: int,
        block_size: int, scratch_block: int, max_model_len: int, aux_layers: tuple[int, ...] = (),
    ) -> None:  # fmt: skip
        device = kv_caches[0].device
        super().__init__(sizes, capture=device.type == "cuda")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.max_model_len = max_model_len
        self.aux_layers = aux_layers
        cfg = model.config
        self.group = cfg.num_attention_heads // cfg.num_key_value_heads
        top = sizes[-1]
        self.max_seqs = min(max_seqs, top)
        self.width = -(-max_model_len // block_size)
        s, tiles = self.max_seqs, tile_capacity(top, self.max_seqs, self.group)
        self.buf = _Buffers({"ids": top, "pos": top, "slots": top, "qstart": s + 1, "ctx": s, "tile_seq": tiles,
                             "tile_q": tiles, "rows": s, "tables": s * self.width}, device)  # fmt: skip
        self._tables = self.buf.np["tables"].reshape(s, self.width)
        self._d_tables = self.buf.d["tables"].view(s, self.width)
        self._table_rows = _TableRows(self._tables)
        self.buf.np["slots"][:] = scratch_block * block_size
        self.buf.np["ctx"][:] = 1
        self.buf.np["tile_seq"][:] = -1
        self.buf.upload(self.buf.dev.numel())
        self._staged = 0
        self._seqs = 0
        self._tokens = 0

    def fits(self, num_tokens: int, num_seqs: int) -> bool:
        return num_tokens <= self.sizes[-1] and num_seqs <= self.max_seqs

    def _shape(self, size: int) -> tuple[int, int]:
        seqs = min(self.max_seqs, size)
        return seqs, tile_capacity(size, seqs, self.group)

    def _forward(self, size: int) -> Outputs:
        seqs, tiles = self._shape(size)
        d = self.buf.d
        meta = AttentionMetadata(
            num_decodes=0,
            slot_mapping=d["slots"][:size],
            block_tables=self._d_tables[:seqs],
            context_lens=d["ctx"][:seqs],
            query_lens=[],
            cached_lens=[],
            max_query_len=size,
            max_context=self.max_model_len,
            query_start=d["qstart"][: seqs + 1],
            tile_map=(d["tile_seq"][:tiles], d["tile_q"][:tiles]),
        )
        hidden, aux = forward_target(self.model, d["ids"][:size], d["pos"][:size], self.kv_caches, meta, None,
                                     self.aux_layers)  # fmt: skip
        logits = self.model.compute_logits(hidden[d["rows"][:seqs].long()])
        return logits, logits.argmax(dim=-1), aux

    def capture_all(self) -> None:
        self.capture(self._forward, "mixed-step")

    def stage(self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, query_lens: list[int],
              context_lens: list[int], sequences: Seq[Sequence], rows: list[int]) -> None:  # fmt: skip
        """Write one step's inputs (at most the largest token count) into the host buffer; ``sequences`` give the
        block tables."""
        self.buf.writable()
        n, seqs = len(ids), len(query_lens)
        size = self.bucket(n)
        bucket_seqs, tiles = self._shape(size)
        b = self.buf.np
        b["ids"][:n] = ids
        b["pos"][:n] = positions
        b["slots"][:n] = slots
        b["ids"][n:size] = 0
        b["pos"][n:size] = 0
        b["slots"][n:size] = self.scratch_block * self.block_size
        b["qstart"][0] = 0
        np.cumsum(query_lens, out=b["qstart"][1 : seqs + 1])
        b["qstart"][seqs + 1 : bucket_seqs + 1] = n  # padding sequences own no query tokens
        b["ctx"][:seqs] = context_lens
        tile_seq, tile_q = tile_map(query_lens, self.group, tiles)
        b["tile_seq"][:tiles] = tile_seq
        b["tile_q"][:tiles] = tile_q
        b["rows"][: len(rows)] = rows
        b["rows"][len(rows) : bucket_seqs] = 0
        self._table_rows.write(sequences)
        self._staged = size
        self._seqs = seqs
        self._tokens = n

    def write_ids(self, at: Seq[int], ids: Seq[int]) -> None:
        """Replace staged token ids (an EAGLE-3 head's drafts, proposed after the step was staged, before its
        replay) at flattened token rows ``at``."""
        self.buf.np["ids"][np.asarray(at, dtype=np.int64)] = ids

    def replay(self, num_rows: int) -> Outputs:
        """Copy the staged inputs over, run the bucket's graph; (logits, greedy tokens) of the sampled rows, and the
        target's hidden states at the head's layers for the step's tokens (when a head is attached)."""
        self.buf.upload(self.buf.offsets["tables"] + self._seqs * self.width)
        logits, tokens, aux = self.run(self._staged)
        return logits[:num_rows], tokens[:num_rows], None if aux is None else aux[: self._tokens]

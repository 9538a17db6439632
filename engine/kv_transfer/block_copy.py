"""One kernel launch that copies a request's KV blocks in every region at once (the ipc pull on a GPU).

A pull copies block ``src_ids[i]`` to block ``dst_ids[i]`` in each of the cache's regions (every
layer's K and V, the indexer keys): 60-90 regions for a small model, each its own allocation. Torch
needs a gather and a scatter per region (or per layer group), launched from Python: ~1-3 ms of
launches for a copy of a few MB. Here the regions are a table of base addresses (int64, on the
device) and one program copies one slice of one block of one region, so the whole pull is one launch
whatever the number of regions or ids. Rows move as 8- or 4-byte words.

Imported only where a CUDA pull or ``TRITON_INTERPRET=1`` (the tests, on CPU tensors) asks for it.
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

BLOCK_WORDS = 1024  # words of a row one program moves


@triton.jit
def _copy_blocks_kernel(src_base, dst_base, row_words, src_ids, dst_ids, WORD: tl.constexpr, BLOCK: tl.constexpr):
    region = tl.program_id(0)
    pair = tl.program_id(1)
    chunk = tl.program_id(2)
    words = tl.load(row_words + region)
    src = tl.load(src_ids + pair)
    dst = tl.load(dst_ids + pair)
    if WORD == 8:
        src_ptr = tl.load(src_base + region).to(tl.pointer_type(tl.int64))
        dst_ptr = tl.load(dst_base + region).to(tl.pointer_type(tl.int64))
    else:
        src_ptr = tl.load(src_base + region).to(tl.pointer_type(tl.int32))
        dst_ptr = tl.load(dst_base + region).to(tl.pointer_type(tl.int32))
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < words  # a region with shorter rows than the longest has nothing past its end
    tl.store(dst_ptr + dst * words + offs, tl.load(src_ptr + src * words + offs, mask=mask), mask=mask)


def word_size(views: Sequence[torch.Tensor]) -> int:
    """The widest word (8 or 4 bytes) every region's base and row width are a multiple of; 0 when none is."""
    for word in (8, 4):
        if all(v.data_ptr() % word == 0 and v.shape[1] % word == 0 and v.stride() == (v.shape[1], 1) for v in views):
            return word
    return 0


class RegionTable:
    """Both sides' regions as the kernel reads them: base addresses and row widths, on the destination device."""

    def __init__(self, src_views: Sequence[torch.Tensor], dst_views: Sequence[torch.Tensor]) -> None:
        if len(src_views) != len(dst_views) or any(
            s.shape[1] != d.shape[1] for s, d in zip(src_views, dst_views, strict=True)
        ):
            raise ValueError("the two sides' regions differ in number or row width")
        self.word = min(word_size(src_views), word_size(dst_views))
        if self.word not in (4, 8):
            raise ValueError("a region's base or row width is not a multiple of 4 bytes")
        device = dst_views[0].device
        self.device = device
        self.regions = len(src_views)
        self.src_base = torch.tensor([v.data_ptr() for v in src_views], dtype=torch.int64, device=device)
        self.dst_base = torch.tensor([v.data_ptr() for v in dst_views], dtype=torch.int64, device=device)
        words = [v.shape[1] // self.word for v in src_views]
        self.row_words = torch.tensor(words, dtype=torch.int64, device=device)
        self.chunks = -(-max(words) // BLOCK_WORDS)
        if device.type == "cuda":  # the tables' uploads done before any stream's kernel reads them
            torch.cuda.current_stream(device).synchronize()

    def copy(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """Launch the copy of ``src_ids[i] -> dst_ids[i]`` in every region, on the current stream."""
        if not src_ids:
            return
        src = torch.tensor(list(src_ids), dtype=torch.int64).to(self.device, non_blocking=True)
        dst = torch.tensor(list(dst_ids), dtype=torch.int64).to(self.device, non_blocking=True)
        grid = (self.regions, len(src_ids), self.chunks)
        _copy_blocks_kernel[grid](self.src_base, self.dst_base, self.row_words, src, dst, WORD=self.word,
                                  BLOCK=BLOCK_WORDS)  # fmt: skip

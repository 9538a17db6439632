"""The one-launch block copy of the ipc pull on a GPU (``engine.kv_transfer.block_copy``): every region's named
blocks land, nothing else is written, with 8- and 4-byte words, and it equals the torch copy. On CPU tensors
through Triton's interpreter (``TRITON_INTERPRET=1``, set before the kernel module is imported); compiled on
the GPU with ``ENGINE_TEST_DEVICE=cuda``."""

from __future__ import annotations

import os

import pytest
import torch

from engine.kv_transfer.ipc import copy_blocks
from engine.kv_transfer.layout import region_views
from tests.engine.conftest import DEVICE

if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytestmark = pytest.mark.timeout(120)


def _views(fill: bool, dtype: torch.dtype, heads: int, idx_dim: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    kv = [(torch.randn(2, 24, 4, heads, 8, generator=g) if fill else torch.zeros(2, 24, 4, heads, 8)).to(dtype)
          for _ in range(3)]  # fmt: skip
    idx = [(torch.randn(24, idx_dim, generator=g) if fill else torch.zeros(24, idx_dim)).to(dtype) for _ in range(3)]
    return region_views([t.to(DEVICE) for t in kv], [t.to(DEVICE) for t in idx])


@pytest.mark.parametrize(("dtype", "heads", "idx_dim", "word"), [(torch.float32, 2, 8, 8), (torch.float16, 3, 8, 8),
                                                                 (torch.float16, 1, 6, 4)])  # fmt: skip
def test_one_launch_copies_exactly_the_named_blocks_of_every_region(
    dtype: torch.dtype, heads: int, idx_dim: int, word: int
) -> None:
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("TRITON_INTERPRET was set to something else before this module; run it in its own process")
    from engine.kv_transfer.block_copy import RegionTable

    src, dst, ref = (_views(fill, dtype, heads, idx_dim) for fill in (True, False, False))
    table = RegionTable(src, dst)
    assert table.word == word and table.regions == len(src) == 9
    src_ids, dst_ids = [3, 9, 1, 22, 0, 17], [5, 20, 2, 8, 11, 23]
    table.copy(src_ids, dst_ids)
    copy_blocks(src, ref, src_ids, dst_ids)
    for r, (s, d, e) in enumerate(zip(src, dst, ref, strict=True)):
        assert torch.equal(d[dst_ids], s[src_ids]), f"region {r}"
        assert torch.equal(d, e), f"region {r}: differs from the torch copy"
        assert not d[sorted(set(range(24)) - set(dst_ids))].any(), f"region {r}: a block outside the destination"


def test_regions_that_do_not_pair_are_refused() -> None:
    from engine.kv_transfer.block_copy import RegionTable

    src = _views(True, torch.float32, 2)
    with pytest.raises(ValueError, match="differ"):
        RegionTable(src, src[:-1])
    odd = [torch.zeros(4, 6, dtype=torch.uint8, device=DEVICE)]  # 6-byte rows: no 4- or 8-byte words
    with pytest.raises(ValueError, match="multiple of 4"):
        RegionTable(odd, [torch.zeros(4, 6, dtype=torch.uint8, device=DEVICE)])

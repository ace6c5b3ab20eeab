"""The cpu tier: the contract, page-aligned zero-copy slot views, pinning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiered_kv.tiers._driver import PAGE
from tiered_kv.tiers.pinned_cpu import PinnedCpuTier

from tiered_kv.interfaces import TransferOp
from tiered_kv.testing import TierDriverContract

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class TestCpuContract(TierDriverContract):
    async def make_tier(self, path: Path, dtype: str) -> PinnedCpuTier:
        return PinnedCpuTier(slot_bytes=3 * 4096 + 100, num_slots=6)


def test_slot_views_are_page_aligned_and_share_the_slab() -> None:
    tier = PinnedCpuTier(slot_bytes=5000, num_slots=3)
    views = [tier.view(slot) for slot in range(3)]
    assert [v.numel() for v in views] == [5000] * 3
    assert all(v.data_ptr() % PAGE == 0 for v in views)
    assert views[1].data_ptr() - views[0].data_ptr() == tier.slot_stride == 2 * PAGE
    assert views[0].untyped_storage().data_ptr() == views[2].untyped_storage().data_ptr()


async def test_bytes_put_through_a_view_are_read_back_by_the_driver() -> None:
    tier = PinnedCpuTier(slot_bytes=4096, num_slots=2)
    tier.view(1).copy_(torch.arange(4096) % 251)
    out = torch.empty(4096, dtype=torch.uint8)
    await tier.read([TransferOp(buffer=out, slot=1)])
    assert torch.equal(out, (torch.arange(4096) % 251).to(torch.uint8))
    await tier.close()


def test_a_view_outside_the_slab_is_refused() -> None:
    tier = PinnedCpuTier(slot_bytes=4096, num_slots=2)
    with pytest.raises(ValueError, match="outside"):
        tier.view(2)


def test_without_cuda_the_slab_is_plain_memory() -> None:
    tier = PinnedCpuTier(slot_bytes=4096, num_slots=2, pin=False)
    assert not tier.pinned and not tier.view(0).is_pinned()


@pytest.mark.cuda
@requires_cuda
async def test_with_cuda_the_slab_is_page_locked() -> None:
    tier = PinnedCpuTier(slot_bytes=1 << 20, num_slots=4)
    assert tier.pinned and tier.view(3).is_pinned()
    await tier.close()

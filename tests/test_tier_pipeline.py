"""The drivers found by name, working together: gpu → cpu → nvme → cpu → gpu."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from conftest import make_namespace

from tiered_kv.interfaces import TierDriver, TransferOp
from tiered_kv.registry import TIERS
from tiered_kv.tiers.gpu import GpuTier
from tiered_kv.tiers.nvme import NvmeTier
from tiered_kv.tiers.pinned_cpu import PinnedCpuTier


def test_the_drivers_are_registered_as_tier_entry_points() -> None:
    assert {"gpu", "cpu", "nvme"} <= set(TIERS.names())
    assert TIERS.get("gpu") is GpuTier
    assert TIERS.get("cpu") is PinnedCpuTier
    assert TIERS.get("nvme") is NvmeTier


async def test_a_chunk_comes_back_bit_identical_through_every_tier(tmp_path: Path) -> None:
    namespace = make_namespace()
    geometry = namespace.geometry
    bpc = geometry.blocks_per_chunk
    gpu_cls: Any = TIERS.get("gpu")
    cpu_cls: Any = TIERS.get("cpu")
    nvme_cls: Any = TIERS.get("nvme")
    layers = [
        torch.randn(2, 3 * bpc, geometry.block_size, 2, 8, generator=torch.Generator().manual_seed(i)).half()
        for i in range(2)
    ]
    gpu: TierDriver = gpu_cls(layers, blocks_per_chunk=bpc, block_dim=1)
    assert gpu.slot_bytes * bpc == geometry.chunk_bytes()
    cpu = cpu_cls(geometry.chunk_bytes(), 2)
    nvme = await nvme_cls.open(tmp_path, namespace, slot_bytes=geometry.chunk_bytes(), num_slots=4)
    stored, loaded = (5, 0, 9, 2), (3, 4, 10, 11)  # the engine's blocks: the chunk, then where it returns
    key = b"k" * 16

    await gpu.read([TransferOp(buffer=cpu.view(0), blocks=stored)])
    await nvme.write([TransferOp(buffer=cpu.view(0), key=key, slot=3)])
    await nvme.read([TransferOp(buffer=cpu.view(1), key=key, slot=3)])
    await gpu.write([TransferOp(buffer=cpu.view(1), blocks=loaded)])

    for layer in layers:
        assert torch.equal(layer[:, list(loaded)].view(torch.int16), layer[:, list(stored)].view(torch.int16))
    for tier in (gpu, cpu, nvme):
        await tier.close()

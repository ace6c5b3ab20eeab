"""Drivers that move no bytes: the control plane alone, for benchmarks and lifecycle tests.

``NullTier`` does everything a driver does except copy: it checks its ops, counts them,
can be held at a gate (to test cancellation and races at a chosen point) and can fail ops
for chosen keys. ``NullTiers`` is a :class:`tiered_kv.manager.TierFactory` of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import NoReturn

import torch

from tiered_kv.config import NvmeTierConfig, RemoteTierConfig
from tiered_kv.driver_base import DriverBase
from tiered_kv.errors import ConfigError, TierIOError
from tiered_kv.interfaces import TransferOp
from tiered_kv.keys import ChunkKey
from tiered_kv.namespace import Namespace

_EMPTY = torch.empty(0, dtype=torch.uint8)


class NullTier(DriverBase):
    def __init__(self, name: str, slot_bytes: int, num_slots: int) -> None:
        super().__init__(name, slot_bytes, num_slots)
        #: When set, every read and write waits here first (clear it to hold copies).
        self.gate = asyncio.Event()
        self.gate.set()
        #: Ops for these keys fail with TierIOError.
        self.fail_keys: set[ChunkKey] = set()

    async def read(self, ops: Sequence[TransferOp]) -> None:
        await self._move(ops)
        self._count(read=True, ops=len(ops), nbytes=0)

    async def write(self, ops: Sequence[TransferOp]) -> None:
        await self._move(ops)
        self._count(read=False, ops=len(ops), nbytes=0)

    async def _move(self, ops: Sequence[TransferOp]) -> None:
        self._check_open()
        if not self.gate.is_set():
            await self.gate.wait()
        failed = [op.key for op in ops if op.key in self.fail_keys]
        if failed:
            self._errors += 1
            raise TierIOError(f"injected failure for {len(failed)} chunk(s)", tier=self.name)

    def view(self, slot: int) -> torch.Tensor:
        return _EMPTY

    def recovered(self) -> dict[ChunkKey, int]:
        return {}

    def forget(self, slots: Iterable[int]) -> None:
        pass

    async def sync(self) -> None:
        self._check_open()

    async def close(self) -> None:
        self._closed = True


class NullTiers:
    """A tier factory of :class:`NullTier` drivers; remembers each one it made."""

    def __init__(self) -> None:
        self.made: dict[str, list[NullTier]] = {"gpu": [], "cpu": [], "nvme": []}

    def _make(self, name: str, slot_bytes: int, num_slots: int) -> NullTier:
        tier = NullTier(name, slot_bytes, num_slots)
        self.made[name].append(tier)
        return tier

    def gpu(self, namespace: Namespace, group: int, tensors: Sequence[torch.Tensor]) -> NullTier:
        num_blocks = tensors[0].shape[0] if tensors else 0
        return self._make("gpu", namespace.geometry.block_bytes(group), num_blocks)

    def cpu(self, namespace: Namespace, group: int, slot_bytes: int, num_slots: int) -> NullTier:
        return self._make("cpu", slot_bytes, num_slots)

    async def nvme(
        self, namespace: Namespace, group: int, slot_bytes: int, num_slots: int, config: NvmeTierConfig
    ) -> NullTier:
        return self._make("nvme", slot_bytes, num_slots)

    async def remote(
        self, namespace: Namespace, group: int, slot_bytes: int, num_slots: int, config: RemoteTierConfig
    ) -> NoReturn:
        raise ConfigError("null tiers have no remote tier", field="remote")

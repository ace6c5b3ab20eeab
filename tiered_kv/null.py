"""Drivers that move no bytes: the control plane alone, for benchmarks and lifecycle tests.

``NullTier`` does everything a driver does except copy: it checks its ops, counts them,
can be held at a gate (to test cancellation and races at a chosen point) and can fail ops
for chosen keys. ``NullTiers`` is a :class:`tiered_kv.manager.TierFactory` of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

import torch

from tiered_kv.config import NvmeTierConfig
from tiered_kv.errors import TierClosedError, TierIOError
from tiered_kv.interfaces import TierStats, TransferOp
from tiered_kv.keys import ChunkKey
from tiered_kv.namespace import Namespace

_EMPTY = torch.empty(0, dtype=torch.uint8)


class NullTier:
    def __init__(self, name: str, slot_bytes: int, num_slots: int) -> None:
        self.name = name
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        #: When set, every read and write waits here first (clear it to hold copies).
        self.gate = asyncio.Event()
        self.gate.set()
        #: Ops for these keys fail with TierIOError.
        self.fail_keys: set[ChunkKey] = set()
        self._reads = self._writes = self._errors = 0
        self._closed = False

    async def read(self, ops: Sequence[TransferOp]) -> None:
        await self._move(ops)
        self._reads += len(ops)

    async def write(self, ops: Sequence[TransferOp]) -> None:
        await self._move(ops)
        self._writes += len(ops)

    async def _move(self, ops: Sequence[TransferOp]) -> None:
        if self._closed:
            raise TierClosedError("used after close", tier=self.name)
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

    def statistics(self) -> TierStats:
        return TierStats(
            name=self.name,
            slot_bytes=self.slot_bytes,
            num_slots=self.num_slots,
            reads=self._reads,
            writes=self._writes,
            errors=self._errors,
        )

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

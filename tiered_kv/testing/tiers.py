"""The tier-driver contract suite and a fault-injecting driver wrapper.

``TierDriverContract`` is a pytest mixin (cachetools style): a test class that mixes it
in and defines :meth:`TierDriverContract.make_tier` runs every contract test against its
driver. Slot tiers (cpu, nvme) keep the default addressing; a tier addressed by blocks
(gpu) overrides :meth:`~TierDriverContract.chunk_bytes`, :meth:`~TierDriverContract.num_chunks`,
:meth:`~TierDriverContract.op` and :meth:`~TierDriverContract.partial_op`. Each test runs
its own event loop (``asyncio.run``), so the suite needs no asyncio plugin. A driver
must have at least 4 chunks.

``FaultyTier`` wraps any driver and injects, from a seed, I/O errors, latency, torn
(partial) writes and a full medium, recording every fault it raised in ``faults``.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import pytest
import torch

from tiered_kv.errors import TierClosedError, TierError, TierFullError, TierIOError
from tiered_kv.interfaces import TierDriver, TierStats, TransferOp
from tiered_kv.keys import ChunkKey
from tiered_kv.layout import DTYPE_BYTES

_SENTINEL = 0xA5


def chunk_data(nbytes: int, dtype: str, seed: int) -> torch.Tensor:
    """Random bytes that start with ``dtype``'s awkward values: NaN, ±0, ±inf, subnormals,
    the extremes (whatever of these the dtype can hold)."""
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    torch_dtype = getattr(torch, dtype)
    if torch_dtype.is_floating_point:
        info = torch.finfo(torch_dtype)
        values = [float("nan"), -0.0, 0.0, float("inf"), float("-inf"), info.tiny / 2, info.max, info.min, info.eps]
        special = torch.tensor(values, dtype=torch.float32).to(torch_dtype)
    else:
        iinfo = torch.iinfo(torch_dtype)
        special = torch.tensor([iinfo.min, iinfo.max, 0, 1, -1 if iinfo.min < 0 else 2], dtype=torch_dtype)
    raw = special.view(torch.uint8)[:nbytes]
    data[: raw.numel()] = raw
    return data


async def _cancel_after(delay: float, work: Awaitable[None]) -> bool:
    """Start ``work``, cancel it after ``delay`` s; whether it ended cancelled (it may
    have finished first)."""
    task = asyncio.ensure_future(work)
    await asyncio.sleep(delay)
    task.cancel()
    await asyncio.wait([task])
    if task.cancelled():
        return True
    task.result()
    return False


class TierDriverContract:
    """Every tier driver passes these tests; mix into a pytest class, define ``make_tier``."""

    #: Whether the tier verifies what it reads, so that a chunk whose write failed or was
    #: cancelled is refused afterwards (nvme). Tiers that verify nothing (cpu, gpu) leave
    #: that to the core's directory.
    verifies_reads: ClassVar[bool] = False

    async def make_tier(self, path: Path, dtype: str) -> TierDriver:
        """A fresh driver whose files (if any) live under ``path``; ``dtype`` is the KV
        cache's dtype where the tier has one."""
        raise NotImplementedError

    def chunk_bytes(self, tier: TierDriver) -> int:
        return tier.slot_bytes

    def num_chunks(self, tier: TierDriver) -> int:
        return tier.num_slots

    def op(self, tier: TierDriver, chunk: int, buffer: torch.Tensor, key: ChunkKey) -> TransferOp:
        """An op moving chunk number ``chunk`` (of :meth:`num_chunks`) to or from ``buffer``."""
        return TransferOp(buffer=buffer, key=key, slot=chunk)

    def partial_op(
        self, tier: TierDriver, chunk: int, buffer: torch.Tensor, key: ChunkKey
    ) -> tuple[TransferOp, torch.Tensor]:
        """An op moving part of a chunk, and the mask of the ``buffer`` bytes it moves.
        Slot tiers: a shorter chunk, at an unaligned length."""
        n = self.chunk_bytes(tier) // 2 + 7
        mask = torch.zeros(buffer.numel(), dtype=torch.bool)
        mask[:n] = True
        return TransferOp(buffer=buffer[:n], key=key, slot=chunk), mask

    # -- helpers -----------------------------------------------------------------------------
    def _key(self, chunk: int, version: int = 0) -> ChunkKey:
        return chunk.to_bytes(8, "little") + version.to_bytes(8, "little")

    def _data(self, tier: TierDriver, chunks: Sequence[int], dtype: str = "uint8", seed: int = 0) -> list[torch.Tensor]:
        return [chunk_data(self.chunk_bytes(tier), dtype, seed * 1_000_003 + c) for c in chunks]

    def _empty(self, tier: TierDriver, n: int) -> list[torch.Tensor]:
        return [torch.full((self.chunk_bytes(tier),), _SENTINEL, dtype=torch.uint8) for _ in range(n)]

    def _ops(
        self, tier: TierDriver, chunks: Sequence[int], buffers: Sequence[torch.Tensor], version: int = 0
    ) -> list[TransferOp]:
        return [self.op(tier, c, b, self._key(c, version)) for c, b in zip(chunks, buffers, strict=True)]

    def _with_tier(self, path: Path, dtype: str, body: Callable[[TierDriver], Coroutine[Any, Any, None]]) -> None:
        """Run ``body`` on a fresh tier in its own event loop, closing the tier after."""

        async def main() -> None:
            tier = await self.make_tier(path, dtype)
            try:
                await body(tier)
            finally:
                await tier.close()

        asyncio.run(main())

    async def _write_read(self, tier: TierDriver, chunks: Sequence[int], data: Sequence[torch.Tensor]) -> None:
        await tier.write(self._ops(tier, chunks, data))
        out = self._empty(tier, len(chunks))
        await tier.read(self._ops(tier, chunks, out))
        for c, want, got in zip(chunks, data, out, strict=True):
            assert torch.equal(got, want), f"chunk {c} came back changed"

    # -- the contract ------------------------------------------------------------------------
    def test_describes_itself(self, tmp_path: Path) -> None:
        async def body(tier: TierDriver) -> None:
            assert isinstance(tier, TierDriver)
            assert tier.name and tier.slot_bytes > 0 and tier.num_slots > 0
            stats = tier.statistics()
            assert isinstance(stats, TierStats)
            assert (stats.name, stats.slot_bytes, stats.num_slots) == (tier.name, tier.slot_bytes, tier.num_slots)
            assert (stats.reads, stats.writes, stats.bytes_read, stats.bytes_written, stats.errors) == (0,) * 5
            assert self.num_chunks(tier) >= 4

        self._with_tier(tmp_path, "uint8", body)

    @pytest.mark.parametrize("dtype", tuple(DTYPE_BYTES))
    def test_round_trip_is_bit_exact_for_every_dtype(self, tmp_path: Path, dtype: str) -> None:
        async def body(tier: TierDriver) -> None:
            chunks = [0, self.num_chunks(tier) - 1]
            await self._write_read(tier, chunks, self._data(tier, chunks, dtype))

        self._with_tier(tmp_path, dtype, body)

    def test_batched_round_trip_in_another_order(self, tmp_path: Path) -> None:
        async def body(tier: TierDriver) -> None:
            chunks = list(range(self.num_chunks(tier)))
            data = self._data(tier, chunks, seed=1)
            await tier.write(self._ops(tier, chunks, data))
            order = chunks[::-1]
            out = self._empty(tier, len(order))
            await tier.read(self._ops(tier, order, out))
            for c, got in zip(order, out, strict=True):
                assert torch.equal(got, data[c]), f"chunk {c} came back changed"

        self._with_tier(tmp_path, "bfloat16", body)

    def test_partial_op_moves_only_its_bytes(self, tmp_path: Path) -> None:
        async def body(tier: TierDriver) -> None:
            [data] = self._data(tier, [1], seed=2)
            write, mask = self.partial_op(tier, 1, data, self._key(1))
            await tier.write([write])
            [out] = self._empty(tier, 1)
            read, _ = self.partial_op(tier, 1, out, self._key(1))
            await tier.read([read])
            assert torch.equal(out[mask], data[mask]), "the moved bytes came back changed"
            assert bool((out[~mask] == _SENTINEL).all()), "bytes outside the op were touched"

        self._with_tier(tmp_path, "float16", body)

    def test_a_write_replaces_what_the_slot_held(self, tmp_path: Path) -> None:
        async def body(tier: TierDriver) -> None:
            await self._write_read(tier, [2], self._data(tier, [2], seed=3))
            await self._write_read(tier, [2], self._data(tier, [2], seed=4))

        self._with_tier(tmp_path, "uint8", body)

    def test_statistics_count_ops_and_bytes(self, tmp_path: Path) -> None:
        async def body(tier: TierDriver) -> None:
            chunks = [0, 1, 2]
            await self._write_read(tier, chunks, self._data(tier, chunks))
            stats = tier.statistics()
            moved = 3 * self.chunk_bytes(tier)
            assert (stats.writes, stats.reads) == (3, 3)
            assert (stats.bytes_written, stats.bytes_read) == (moved, moved)
            assert stats.errors == 0

        self._with_tier(tmp_path, "uint8", body)

    def test_use_after_close_raises_closed_error(self, tmp_path: Path) -> None:
        async def body() -> None:
            tier = await self.make_tier(tmp_path, "uint8")
            data = self._data(tier, [0])
            await tier.write(self._ops(tier, [0], data))
            await tier.close()
            await tier.close()  # closing twice is harmless
            with pytest.raises(TierClosedError):
                await tier.write(self._ops(tier, [0], data))
            with pytest.raises(TierClosedError):
                await tier.read(self._ops(tier, [0], self._empty(tier, 1)))
            assert tier.statistics().writes == 1

        asyncio.run(body())

    def test_an_op_outside_the_tier_is_rejected(self, tmp_path: Path) -> None:
        async def body(tier: TierDriver) -> None:
            [data] = self._data(tier, [0])
            with pytest.raises(ValueError):
                await tier.write([self.op(tier, 0, data.to(torch.int16), self._key(0))])
            with pytest.raises(ValueError):
                await tier.write([self.op(tier, 0, torch.cat([data, data]), self._key(0))])
            outside = msgspec.structs.replace(self.op(tier, 0, data, self._key(0)), slot=-2, blocks=(-2,))
            with pytest.raises(ValueError):
                await tier.write([outside])
            assert tier.statistics().writes == 0

        self._with_tier(tmp_path, "uint8", body)

    def test_concurrent_reads_and_writes_to_different_slots(self, tmp_path: Path) -> None:
        async def body(tier: TierDriver) -> None:
            chunks = list(range(self.num_chunks(tier)))
            data = self._data(tier, chunks, seed=5)
            readers, writers = chunks[::2], chunks[1::2]
            await tier.write(self._ops(tier, readers, [data[c] for c in readers]))
            out = self._empty(tier, len(readers))
            await asyncio.gather(
                *(tier.read(self._ops(tier, [c], [o])) for c, o in zip(readers, out, strict=True)),
                *(tier.write(self._ops(tier, [c], [data[c]])) for c in writers),
            )
            for c, got in zip(readers, out, strict=True):
                assert torch.equal(got, data[c]), f"chunk {c} came back changed"
            out = self._empty(tier, len(writers))
            await tier.read(self._ops(tier, writers, out))
            for c, got in zip(writers, out, strict=True):
                assert torch.equal(got, data[c]), f"chunk {c} came back changed"

        self._with_tier(tmp_path, "uint8", body)

    def test_a_cancelled_read_has_stopped_touching_its_buffers(self, tmp_path: Path) -> None:
        async def body(tier: TierDriver) -> None:
            chunks = list(range(self.num_chunks(tier)))
            await tier.write(self._ops(tier, chunks, self._data(tier, chunks)))
            for delay in (0.0, 0.0005, 0.002):
                out = self._empty(tier, len(chunks))
                await _cancel_after(delay, tier.read(self._ops(tier, chunks, out)))
                for buffer in out:
                    buffer.fill_(_SENTINEL)
                await asyncio.sleep(0.02)  # a copy still running would now overwrite the sentinel
                assert all(bool((b == _SENTINEL).all()) for b in out), "a copy ran on after the cancel"
            await self._write_read(tier, chunks[:1], self._data(tier, chunks[:1], seed=6))  # still usable

        self._with_tier(tmp_path, "uint8", body)

    def test_a_cancelled_write_leaves_nothing_a_read_accepts(self, tmp_path: Path) -> None:
        async def body(tier: TierDriver) -> None:
            chunks = list(range(self.num_chunks(tier)))
            await tier.write(self._ops(tier, chunks, self._data(tier, chunks, seed=7)))
            new = self._data(tier, chunks, seed=8)
            cancelled = await _cancel_after(0, tier.write(self._ops(tier, chunks, new, version=1)))
            for c in chunks:
                out = self._empty(tier, 1)
                if not cancelled:
                    await tier.read(self._ops(tier, [c], out, version=1))
                    assert torch.equal(out[0], new[c])
                elif self.verifies_reads:
                    for version in (0, 1):
                        with pytest.raises(TierError):
                            await tier.read(self._ops(tier, [c], out, version=version))
            await self._write_read(tier, chunks[:1], self._data(tier, chunks[:1], seed=9))  # still usable

        self._with_tier(tmp_path, "uint8", body)


class Fault(msgspec.Struct, frozen=True, kw_only=True):
    """One fault :class:`FaultyTier` injected, by call number (from 0)."""

    call: int
    op: str
    #: ``error`` (nothing moved), ``late_error`` (a read moved its bytes, then failed),
    #: ``torn`` (a write moved only a prefix, then failed) or ``full``.
    kind: str


class FaultyTier:
    """A driver wrapper that injects faults, reproducibly from ``seed``.

    Per call: an optional delay of up to ``max_latency_s``; then with probability
    ``error_rate`` a :class:`TierIOError` (a read errs before or after moving its bytes,
    a write before moving any); for writes, with probability ``torn_rate``, the ops before
    a chosen one are written whole, that one only in part (a prefix of its buffer, or of
    its blocks), and :class:`TierIOError` is raised. Once ``full_after_bytes`` would be
    exceeded, every write raises :class:`TierFullError` and moves nothing. Anything
    else (``view``, ``recovered`` …) is the wrapped driver's.
    """

    def __init__(
        self,
        inner: TierDriver,
        *,
        seed: int,
        error_rate: float = 0.0,
        torn_rate: float = 0.0,
        max_latency_s: float = 0.0,
        full_after_bytes: int | None = None,
    ) -> None:
        self.inner = inner
        self.name = inner.name
        self.slot_bytes = inner.slot_bytes
        self.num_slots = inner.num_slots
        self.error_rate = error_rate
        self.torn_rate = torn_rate
        self.max_latency_s = max_latency_s
        self.full_after_bytes = full_after_bytes
        #: Every fault raised so far, in call order.
        self.faults: list[Fault] = []
        self._rng = random.Random(seed)
        self._calls = 0
        self._written = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _fail(self, call: int, op: str, kind: str) -> TierError:
        self.faults.append(Fault(call=call, op=op, kind=kind))
        if kind == "full":
            return TierFullError(f"injected: no room left (call {call})", tier=self.name)
        return TierIOError(f"injected: {kind.replace('_', ' ')} in {op} (call {call})", tier=self.name)

    async def _start(self) -> tuple[int, float]:
        call = self._calls
        self._calls += 1
        if self.max_latency_s:
            await asyncio.sleep(self._rng.uniform(0, self.max_latency_s))
        return call, self._rng.random()

    async def read(self, ops: Sequence[TransferOp]) -> None:
        call, draw = await self._start()
        if draw < self.error_rate / 2:
            raise self._fail(call, "read", "error")
        await self.inner.read(ops)
        if draw < self.error_rate:
            raise self._fail(call, "read", "late_error")

    async def write(self, ops: Sequence[TransferOp]) -> None:
        call, draw = await self._start()
        nbytes = sum(len(op.blocks) * self.slot_bytes if op.blocks else op.buffer.numel() for op in ops)
        if self.full_after_bytes is not None and self._written + nbytes > self.full_after_bytes:
            raise self._fail(call, "write", "full")
        if draw < self.error_rate:
            raise self._fail(call, "write", "error")
        if draw < self.error_rate + self.torn_rate and ops:
            torn = self._rng.randrange(len(ops))
            await self.inner.write([*ops[:torn], *self._prefix(ops[torn])])
            raise self._fail(call, "write", "torn")
        await self.inner.write(ops)
        self._written += nbytes

    def _prefix(self, op: TransferOp) -> list[TransferOp]:
        """A strict prefix of ``op`` (nothing, when its only block is left out)."""
        if op.blocks:
            keep = self._rng.randrange(len(op.blocks))
            return [msgspec.structs.replace(op, blocks=op.blocks[:keep])] if keep else []
        n = op.buffer.numel()
        return [msgspec.structs.replace(op, buffer=op.buffer[: self._rng.randrange(1, n)])] if n > 1 else []

    def statistics(self) -> TierStats:
        stats = self.inner.statistics()
        return msgspec.structs.replace(stats, errors=stats.errors + len(self.faults))

    async def close(self) -> None:
        await self.inner.close()

    def __repr__(self) -> str:
        return f"<FaultyTier {self.inner!r} calls={self._calls} faults={len(self.faults)}>"

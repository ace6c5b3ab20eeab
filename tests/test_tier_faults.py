"""Injected faults (FaultyTier) over every driver: each fault reaches the caller as a typed
error, and no read ever hands back bytes other than those written.

Reads go to chunks whose last write succeeded and, on the nvme tier (which verifies), also
to chunks whose last write failed: those are refused, or (when the failed batch's op had
landed whole before the error) served with exactly the bytes that write carried."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import torch
from conftest import make_namespace

from tiered_kv.errors import CorruptChunk, TierError, TierFullError, TierIOError
from tiered_kv.interfaces import TierDriver, TransferOp
from tiered_kv.testing import FaultyTier
from tiered_kv.tiers.gpu import GpuTier
from tiered_kv.tiers.nvme import NvmeTier
from tiered_kv.tiers.pinned_cpu import PinnedCpuTier

CHUNK = 2 * 4096
CHUNKS = 6
BPC = 2


async def cpu(path: Path) -> TierDriver:
    return PinnedCpuTier(CHUNK, CHUNKS)


async def nvme(path: Path) -> TierDriver:
    return await NvmeTier.open(path, make_namespace(), slot_bytes=CHUNK, num_slots=CHUNKS, io_depth=2)


async def gpu(path: Path) -> TierDriver:
    return GpuTier([torch.zeros(BPC * CHUNKS, CHUNK // BPC, dtype=torch.uint8)], blocks_per_chunk=BPC)


DRIVERS: dict[str, Callable[[Path], Awaitable[TierDriver]]] = {"cpu": cpu, "nvme": nvme, "gpu": gpu}


def chunk_op(driver: str, chunk: int, buffer: torch.Tensor, version: int) -> TransferOp:
    key = chunk.to_bytes(8, "little") + version.to_bytes(8, "little")
    if driver == "gpu":
        return TransferOp(buffer=buffer, key=key, blocks=(BPC * chunk + 1, BPC * chunk))
    return TransferOp(buffer=buffer, key=key, slot=chunk)


def chunk_data(chunk: int, version: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(chunk * 100_003 + version)
    return torch.randint(0, 256, (CHUNK,), dtype=torch.uint8, generator=generator)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("driver", list(DRIVERS))
async def test_every_fault_is_typed_and_no_read_returns_other_bytes(tmp_path: Path, driver: str, seed: int) -> None:
    tier = FaultyTier(
        await DRIVERS[driver](tmp_path),
        seed=seed,
        error_rate=0.15,
        torn_rate=0.15,
        max_latency_s=0.001,
        full_after_bytes=40 * CHUNK,
    )
    verifies = driver == "nvme"
    rng = random.Random(seed)
    written: dict[int, tuple[int, bool]] = {}  # chunk -> (last version written, whether the write succeeded)
    raised: dict[int, TierError] = {}
    reads_failed_write: dict[int, bool] = {}
    served = 0
    for call in range(120):
        if rng.random() < 0.5:
            chunks = rng.sample(range(CHUNKS), rng.randint(1, 3))
            ops = [chunk_op(driver, c, chunk_data(c, call), call) for c in chunks]
            try:
                await tier.write(ops)
                ok = True
            except TierError as exc:
                raised[call], ok = exc, False
            written.update({c: (call, ok) for c in chunks})
        else:
            candidates = [c for c, (_, ok) in written.items() if ok or verifies]
            chunk = rng.choice(candidates) if candidates else 0
            version, ok = written.get(chunk, (0, False))
            out = torch.zeros(CHUNK, dtype=torch.uint8)
            ops = [chunk_op(driver, chunk, out, version)] if candidates else []
            reads_failed_write[call] = bool(ops) and not ok
            try:
                await tier.read(ops)
            except TierError as exc:
                raised[call] = exc
                continue
            if ops:
                # A failed write may have landed whole before its error: then these bytes.
                assert torch.equal(out, chunk_data(chunk, version)), f"call {call}: chunk {chunk} came back changed"
            served += 1

    injected = {f.call: f.kind for f in tier.faults}
    assert {"error", "torn", "full"} <= set(injected.values()), "the workload should meet every kind of fault"
    assert served > 10
    for call, kind in injected.items():
        assert call in raised, f"call {call}: injected {kind} was not raised"
        assert isinstance(raised[call], TierFullError if kind == "full" else TierIOError)
    for call in set(raised) - set(injected):
        # Only a verifying tier raises by itself here: for a chunk whose write failed.
        assert reads_failed_write[call] and isinstance(raised[call], CorruptChunk), f"call {call}: {raised[call]!r}"
    assert tier.statistics().errors >= len(injected)
    await tier.close()


async def test_faults_are_reproducible_from_the_seed(tmp_path: Path) -> None:
    async def run() -> list[tuple[int, str]]:
        tier = FaultyTier(await cpu(tmp_path), seed=7, error_rate=0.3, torn_rate=0.3)
        for call in range(30):
            with contextlib.suppress(TierError):
                await tier.write([chunk_op("cpu", call % CHUNKS, chunk_data(0, 0), 0)])
        await tier.close()
        return [(f.call, f.kind) for f in tier.faults]

    first = await run()
    assert first and first == await run()


async def test_the_wrapped_drivers_extras_stay_reachable(tmp_path: Path) -> None:
    inner = PinnedCpuTier(CHUNK, CHUNKS)
    tier = FaultyTier(inner, seed=0)
    assert tier.view(2).data_ptr() == inner.view(2).data_ptr()
    assert (tier.name, tier.slot_bytes, tier.num_slots) == ("cpu", CHUNK, CHUNKS)
    await tier.close()

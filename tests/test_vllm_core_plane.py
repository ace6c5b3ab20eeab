"""The engine core's data plane: nvme I/O on the cpu slab's slots on a thread of its own,
results drained without blocking, warm restart in batches, corrupt chunks reported as such,
promotions bounded by a deadline."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_namespace

from tiered_kv.config import NvmeTierConfig
from tiered_kv.errors import TierClosedError, TieredKVError
from tiered_kv.integrations.vllm import core_plane
from tiered_kv.integrations.vllm.core_plane import CoreDataPlane, Done, NvmeCopy, Outcome, Recovered
from tiered_kv.interfaces import TransferOp
from tiered_kv.registry import TIERS
from tiered_kv.tiers.nvme import NvmeTier
from tiered_kv.tiers.nvme_format import HEADER_BYTES, slot_stride
from tiered_kv.tiers.pinned_cpu import PinnedCpuTier

SLOT = 2 * 4096 + 8
SLOTS = 6


def key(n: int) -> bytes:
    return bytes([n]) * 16


def make(root: Path, cpu: PinnedCpuTier | None = None) -> tuple[CoreDataPlane[str], PinnedCpuTier]:
    cpu = cpu or PinnedCpuTier(slot_bytes=SLOT, num_slots=SLOTS, pin=False)
    config = NvmeTierConfig(root=str(root), capacity_bytes=1 << 20, io_depth=2)
    return CoreDataPlane(make_namespace(), [cpu], config, nvme_slots=SLOTS), cpu


@contextlib.contextmanager
def open_plane(root: Path) -> Iterator[tuple[CoreDataPlane[str], PinnedCpuTier, list[tuple[bytes, int]]]]:
    """A data plane whose stores are open: the plane, its cpu tier, the chunks it recovered."""
    plane, cpu = make(root)
    try:
        plane.open()
        recovered = [c for r in results_until(plane, opened) if isinstance(r, Recovered) for c in r.chunks]
        yield plane, cpu, recovered
    finally:
        plane.close()


def written(plane: CoreDataPlane[str], cpu: PinnedCpuTier, chunks: dict[int, int]) -> None:
    """Fill cpu slot ``n`` with seeded bytes and write it to nvme slot ``chunks[n]`` as ``key(n)``."""
    for n in chunks:
        fill(cpu, n, seed=n)
    plane.write("w", 0, [NvmeCopy(key(n), cpu_slot=n, nvme_slot=slot) for n, slot in chunks.items()])
    assert outcome(results_until(plane, ended("w")), "w").outcome is Outcome.OK


def results_until(plane: CoreDataPlane[str], done: Callable[[list[object]], bool], timeout: float = 30) -> list[object]:
    seen: list[object] = []
    deadline = time.monotonic() + timeout
    while not done(seen):
        seen += plane.results()
        assert time.monotonic() < deadline, f"gave up waiting; got {seen}"
        time.sleep(0.002)
    return seen


def opened(seen: list[object]) -> bool:
    return any(isinstance(r, Recovered) and r.last for r in seen)


def ended(ticket: str) -> Callable[[list[object]], bool]:
    return lambda seen: any(isinstance(r, Done) and r.ticket == ticket for r in seen)


def outcome(seen: list[object], ticket: str) -> Done[str]:
    [found] = [r for r in seen if isinstance(r, Done) and r.ticket == ticket]
    return found


def fill(cpu: PinnedCpuTier, slot: int, seed: int) -> torch.Tensor:
    data = torch.randint(0, 256, (SLOT,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    cpu.view(slot).copy_(data)
    return data


def test_a_written_chunk_is_promoted_back_verified_and_survives_a_restart(tmp_path: Path) -> None:
    # Given a fresh store
    with open_plane(tmp_path) as (plane, cpu, recovered):
        assert recovered == []
        # When cpu slot 2 is written to nvme slot 5, then promoted into cpu slot 4
        written(plane, cpu, {2: 5})
        plane.promote("p", 0, [NvmeCopy(key(2), cpu_slot=4, nvme_slot=5)], deadline_s=30)
        # Then the bytes are back, in the other slot
        assert outcome(results_until(plane, ended("p")), "p").outcome is Outcome.OK
        assert torch.equal(cpu.view(4), cpu.view(2))
    # And a new engine core finds the chunk again (the warm restart)
    with open_plane(tmp_path) as (_, _, recovered):
        assert recovered == [(key(2), 5)]


def test_a_corrupt_chunk_is_reported_corrupt_never_ok(tmp_path: Path) -> None:
    with open_plane(tmp_path) as (plane, cpu, _):
        written(plane, cpu, {0: 1})
        # A bit flips on disk in the chunk's payload
        [slots] = list(tmp_path.glob("*/g0.slots"))
        where = slot_stride(SLOT) + HEADER_BYTES + 100  # nvme slot 1, 100 bytes into the payload
        with slots.open("r+b") as f:
            f.seek(where)
            byte = f.read(1)
            f.seek(where)
            f.write(bytes([byte[0] ^ 0x01]))
        plane.promote("p", 0, [NvmeCopy(key(0), cpu_slot=3, nvme_slot=1)], deadline_s=30)
        done = outcome(results_until(plane, ended("p")), "p")
        assert done.outcome is Outcome.CORRUPT and "checksum" in done.reason
        # An unknown key in a slot is corrupt too: the store vouches for nothing else
        plane.promote("q", 0, [NvmeCopy(key(9), cpu_slot=3, nvme_slot=2)], deadline_s=30)
        assert outcome(results_until(plane, ended("q")), "q").outcome is Outcome.CORRUPT


def test_a_promotion_past_its_deadline_fails_and_lets_go_of_the_slot(tmp_path: Path) -> None:
    # Given an nvme store whose reads hang until released
    release = threading.Event()
    reading = threading.Event()

    class StuckNvme(NvmeTier):
        def _read_one(self, op: Any, data: memoryview) -> None:
            reading.set()
            release.wait(30)
            super()._read_one(op, data)

    TIERS.register("nvme", StuckNvme)
    try:
        with open_plane(tmp_path) as (plane, cpu, _):
            written(plane, cpu, {0: 0})
            # When a promotion's deadline passes while the disk is stuck
            plane.promote("p", 0, [NvmeCopy(key(0), cpu_slot=1, nvme_slot=0)], deadline_s=0.2)
            assert reading.wait(10)
            time.sleep(0.3)
            # Then it is not reported before the read let go of the slot ...
            assert not ended("p")(plane.results())
            release.set()
            # ... and then it is reported failed, naming the deadline
            done = outcome(results_until(plane, ended("p")), "p")
            assert done.outcome is Outcome.FAILED and "0.2 s" in done.reason
    finally:
        release.set()
        TIERS.unregister("nvme")


def test_a_second_engine_on_the_same_nvme_directory_is_refused_loudly(tmp_path: Path) -> None:
    with open_plane(tmp_path):
        second, _ = make(tmp_path)
        try:
            second.open()
            with pytest.raises(TieredKVError, match="in use by a manager or driver of this process"):
                results_until(second, lambda seen: False, timeout=30)
        finally:
            second.close()


def test_a_large_recovered_index_comes_back_in_bounded_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core_plane, "RESTORE_BATCH", 2)
    with open_plane(tmp_path) as (plane, cpu, _):
        written(plane, cpu, {n: n for n in range(5)})
    again, _ = make(tmp_path)
    try:
        again.open()
        batches = [r for r in results_until(again, opened) if isinstance(r, Recovered)]
        assert [len(b.chunks) for b in batches] == [2, 2, 1]
        assert [b.last for b in batches] == [False, False, True]
        assert sorted(c for b in batches for c in b.chunks) == [(key(n), n) for n in range(5)]
    finally:
        again.close()


async def test_close_closes_the_cpu_tiers_too(tmp_path: Path) -> None:
    with open_plane(tmp_path) as (_, cpu, _):
        pass
    with pytest.raises(TierClosedError):
        await cpu.read([TransferOp(buffer=torch.empty(8, dtype=torch.uint8), slot=0)])


def test_forgotten_slots_do_not_come_back_after_a_restart(tmp_path: Path) -> None:
    with open_plane(tmp_path) as (plane, cpu, _):
        written(plane, cpu, {0: 0, 1: 1})
        plane.forget(0, [0])
    with open_plane(tmp_path) as (again, _, recovered):
        assert recovered == [(key(1), 1)]
    with pytest.raises(TieredKVError, match="closed"):
        again.write("x", 0, [])

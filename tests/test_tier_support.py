"""What the drivers share: waiting out worker threads on cancel, batches split for threads,
the nvme slot header."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from tiered_kv.errors import CorruptChunk
from tiered_kv.tiers._driver import in_threads, settle, split
from tiered_kv.tiers.nvme_format import (
    MAX_KEY_BYTES,
    pack_header,
    payload_checksum,
    read_header,
)

FINGERPRINT = bytes(range(32))


async def test_a_cancelled_wait_returns_only_once_the_work_is_done() -> None:
    release = threading.Event()
    finished = []

    def work() -> None:
        release.wait(10)
        finished.append(True)

    with ThreadPoolExecutor(1) as pool:
        task = asyncio.ensure_future(in_threads(pool, work, [()]))
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.sleep(0.01)
        task.cancel()  # a second cancellation is held back too
        await asyncio.sleep(0.01)
        assert not task.done()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished == [True]


async def test_calls_not_started_when_cancelled_never_run() -> None:
    release, started = threading.Event(), threading.Event()
    ran: list[int] = []

    def work(i: int) -> None:
        started.set()
        release.wait(10)
        ran.append(i)

    with ThreadPoolExecutor(1) as pool:
        task = asyncio.ensure_future(in_threads(pool, work, [(0,), (1,), (2,)]))
        assert await asyncio.to_thread(started.wait, 10)  # call 0 runs; 1 and 2 wait for the thread
        task.cancel()
        await asyncio.sleep(0.01)
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert ran == [0]


async def test_an_error_is_raised_after_every_call_has_finished() -> None:
    finished = []

    def work(i: int) -> int:
        if i == 0:
            raise OSError("first fails at once")
        threading.Event().wait(0.05)
        finished.append(i)
        return i

    with ThreadPoolExecutor(3) as pool:
        with pytest.raises(OSError, match="first fails"):
            await in_threads(pool, work, [(0,), (1,), (2,)])
        assert sorted(finished) == [1, 2]
        assert await in_threads(pool, work, [(1,), (2,)]) == [1, 2]
        assert await in_threads(pool, work, []) == []


async def test_settle_returns_the_result() -> None:
    future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    future.set_result(3)
    assert await settle(future) == 3


def test_a_batch_splits_into_near_equal_runs() -> None:
    assert split([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4, 5]]
    assert split([1], 4) == [[1]]
    assert split([], 2) == []


def test_a_header_round_trips() -> None:
    checksum = payload_checksum(memoryview(b"payload"))
    header = pack_header(fingerprint=FINGERPRINT, slot=7, key=b"k" * 16, length=7, checksum=checksum)
    assert len(header) <= 512  # one sector
    assert read_header(header, fingerprint=FINGERPRINT, slot=7) == (b"k" * 16, 7, checksum)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda h: b"X" + h[1:], "no chunk header"),
        (lambda h: h[:40] + bytes([h[40] ^ 1]) + h[41:], "header checksum"),
    ],
)
def test_a_damaged_header_is_refused(change: object, reason: str) -> None:
    header = pack_header(fingerprint=FINGERPRINT, slot=1, key=b"k", length=1, checksum=bytes(16))
    with pytest.raises(CorruptChunk, match=reason):
        read_header(change(header), fingerprint=FINGERPRINT, slot=1)  # type: ignore[operator]


def test_a_header_of_another_namespace_or_slot_is_refused() -> None:
    header = pack_header(fingerprint=FINGERPRINT, slot=1, key=b"k", length=1, checksum=bytes(16))
    with pytest.raises(CorruptChunk, match="another namespace"):
        read_header(header, fingerprint=bytes(32), slot=1)
    with pytest.raises(CorruptChunk, match="written for slot 1"):
        read_header(header, fingerprint=FINGERPRINT, slot=2)


def test_keys_longer_than_the_header_holds_are_refused() -> None:
    with pytest.raises(ValueError):
        pack_header(fingerprint=FINGERPRINT, slot=0, key=bytes(MAX_KEY_BYTES + 1), length=1, checksum=bytes(16))

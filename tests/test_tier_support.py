"""What the drivers share: waiting out worker threads on cancel, batches split for threads,
the nvme slot header."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import importlib.util
import mmap
import os
import random
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_kv import _slotwrite
from tiered_kv.errors import CorruptChunk
from tiered_kv.tiers._driver import WorkerPool, bytes_of_each, check_buffer, in_threads, settle, split, thread_parts
from tiered_kv.tiers.nvme_format import (
    FORMAT_VERSION,
    HEADER_BYTES,
    MAGIC,
    MAX_KEY_BYTES,
    PACKED_IN_C,
    pack_header,
    payload_checksum,
    read_header,
)

FINGERPRINT = bytes(range(32))


def assert_runs_to_its_end(code: str, last_line: str) -> None:
    """``code`` in a Python process of its own ends, with status 0, having printed ``last_line``
    (a process, so that a hang fails the test instead of stopping the run)."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0 and result.stdout == f"{last_line}\n", result.stderr


@contextlib.contextmanager
def pool_of(workers: int) -> Iterator[WorkerPool]:
    pool = WorkerPool("test", workers)
    try:
        yield pool
    finally:
        pool.shutdown()


async def test_a_cancelled_wait_returns_only_once_the_work_is_done() -> None:
    release = threading.Event()
    finished = []

    def work() -> None:
        release.wait(10)
        finished.append(True)

    with pool_of(1) as pool:
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

    with pool_of(1) as pool:
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

    with pool_of(3) as pool:
        with pytest.raises(OSError, match="first fails"):
            await in_threads(pool, work, [(0,), (1,), (2,)])
        assert sorted(finished) == [1, 2]
        assert await in_threads(pool, work, [(1,), (2,)]) == [1, 2]
        assert await in_threads(pool, work, []) == []


async def test_the_awaiting_task_resumes_a_turn_of_the_loop_after_the_last_call() -> None:
    """Regression: the result came through five futures and tasks chained one after the
    other, each a turn of the loop; a busy loop makes every turn a wait for all the work
    ready in it (2.4 ms from a 74 us copy's end to its store resuming, in `bench scale`)."""
    loop = asyncio.get_running_loop()
    turns, at_end = [0], []

    def count() -> None:
        turns[0] += 1
        loop.call_soon(count)

    def work() -> None:
        threading.Event().wait(0.02)
        at_end.append(turns[0])

    loop.call_soon(count)
    with pool_of(1) as pool:
        await in_threads(pool, work, [()])
        resumed = turns[0]
    # Two turns: the loop counts the call finished, then runs the task (three at most, if
    # the thread ended just before the loop's turn counted itself); it took five before.
    assert resumed - at_end[0] <= 3


class _RefusesAfter(WorkerPool):
    """A pool that takes ``n`` calls and then refuses, as one shut down does."""

    __slots__ = ("left",)

    def __init__(self, n: int) -> None:
        super().__init__("test", 2)
        self.left = n

    def submit(self, call):  # type: ignore[no-untyped-def]
        if not self.left:
            raise RuntimeError("cannot schedule new calls after shutdown")
        self.left -= 1
        super().submit(call)


async def test_a_refused_submission_raises_once_the_calls_it_started_have_finished() -> None:
    finished = []

    def work(i: int) -> None:
        threading.Event().wait(0.05)
        finished.append(i)

    pool = _RefusesAfter(2)
    with pytest.raises(RuntimeError, match="after shutdown"):
        await in_threads(pool, work, [(0,), (1,), (2,)])
    assert sorted(finished) == [0, 1]
    pool.shutdown()


async def test_calls_a_worker_thread_that_could_not_start_takes_fail_instead_of_hanging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A thread whose start-up fails (torch's thread setting, say) fails each call it
    takes with the reason: no call waits for a thread that is gone."""

    def cannot_start() -> None:
        raise ValueError("no thread for you")

    pool = WorkerPool("test", 1, init=cannot_start)
    with pytest.raises(RuntimeError, match="could not start: ValueError") as raised:
        await asyncio.wait_for(in_threads(pool, lambda i: i, [(0,), (1,)]), 5)
    assert isinstance(raised.value.__cause__, ValueError)
    pool.shutdown()


async def test_a_pool_shut_down_runs_what_it_queued_then_refuses() -> None:
    release = threading.Event()
    ran: list[int] = []

    def work(i: int) -> int:
        release.wait(10)
        ran.append(i)
        return i

    pool = WorkerPool("test", 1)
    task = asyncio.ensure_future(in_threads(pool, work, [(0,), (1,), (2,)]))
    await asyncio.sleep(0.01)
    pool.shutdown(wait=False)
    with pytest.raises(RuntimeError, match="after shutdown"):
        await in_threads(pool, work, [(3,)])
    release.set()
    assert await asyncio.wait_for(task, 5) == [0, 1, 2]
    await asyncio.to_thread(pool.shutdown)  # waits for its threads: they have ended
    assert ran == [0, 1, 2]


def test_a_pool_dropped_without_a_shutdown_ends_its_threads() -> None:
    pool = WorkerPool("dropped", 2)
    threads = list(pool._threads)
    ref = weakref.ref(pool)
    del pool
    gc.collect()
    assert ref() is None
    for thread in threads:
        thread.join(5)
        assert not thread.is_alive()


def test_the_interpreter_exits_with_a_pool_nobody_shut_down() -> None:
    """Its threads are not daemons (a copy is never cut off at exit); an exit hook ends
    them, as concurrent.futures does for its executors."""
    code = (
        "import threading\n"
        "from tiered_kv.tiers._driver import WorkerPool\n"
        "pool = WorkerPool('left-open', 2)\n"
        "done = []\n"
        "pool.submit((type('B', (), {'run': lambda self, i, fn, args: done.append(fn(*args))})(), 0, len, ('ab',)))\n"
        "print('exiting')\n"
    )
    assert_runs_to_its_end(code, "exiting")


async def test_a_cancellation_during_a_refused_submission_is_not_lost() -> None:
    """Regression (adversarial review): cancelled while it waited out the calls it had
    submitted, the wait raised the refusal and the task did not end cancelled."""

    def work(i: int) -> None:
        threading.Event().wait(0.1)

    pool = _RefusesAfter(1)
    task = asyncio.ensure_future(in_threads(pool, work, [(0,), (1,)]))
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    pool.shutdown()


@pytest.mark.parametrize("seed", range(30))
async def test_random_calls_errors_and_cancellations_never_leave_a_call_running(seed: int) -> None:
    """Randomized: whatever finishes the wait (results, the first error in call order, a
    cancellation, twice), every call that started has finished by then, none starts later,
    and results come back in call order."""
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    delays = [rng.choice([0.0, 0.001, 0.005, 0.02]) for _ in range(n)]
    failing = {i for i in range(n) if rng.random() < 0.2}
    running, started, done = set(), [], []
    lock = threading.Lock()

    def work(i: int) -> int:
        with lock:
            running.add(i)
            started.append(i)
        threading.Event().wait(delays[i])
        with lock:
            running.discard(i)
            done.append(i)
        if i in failing:
            raise OSError(f"call {i}")
        return i * 10

    with pool_of(rng.randint(1, 3)) as pool:
        task = asyncio.ensure_future(in_threads(pool, work, [(i,) for i in range(n)]))
        cancels = rng.choice([0, 0, 1, 2])
        for _ in range(cancels):
            await asyncio.sleep(rng.choice([0.0, 0.002, 0.01]))
            task.cancel()
        if rng.random() < 0.2:  # the pool is shut down meanwhile: what it queued still runs
            await asyncio.sleep(rng.choice([0.0, 0.002, 0.01]))
            pool.shutdown(wait=False)
        try:
            result = await asyncio.wait_for(asyncio.shield(task), 10)
        except asyncio.CancelledError:
            result = None
        except OSError as exc:
            assert str(exc) == f"call {min(failing)}"
            result = None
        with lock:
            assert not running, f"calls {running} still running after the wait ended"
            seen = list(started)
        if result is not None:
            assert result == [i * 10 for i in range(n)] and not failing
        await asyncio.sleep(0.03)
        with lock:
            assert started == seen, "a call started after the wait ended"
            assert sorted(done) == sorted(started)


async def test_settle_returns_the_result() -> None:
    future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    future.set_result(3)
    assert await settle(future) == 3


def test_a_batch_splits_into_near_equal_runs() -> None:
    assert split([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4, 5]]
    assert split([1], 4) == [[1]]
    assert split([], 2) == []


def test_a_call_takes_a_thread_per_mib_up_to_the_workers() -> None:
    assert thread_parts(128 << 10, 4) == 1  # 32 chunks of 4 KiB: the hand-off would cost more
    assert thread_parts(3 << 20, 4) == 3
    assert thread_parts(64 << 20, 2) == 2


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


@pytest.mark.parametrize("failure", [RuntimeError("can't start new thread"), KeyboardInterrupt()])
def test_a_pool_that_cannot_start_all_its_threads_ends_those_it_started(
    monkeypatch: pytest.MonkeyPatch, failure: BaseException
) -> None:
    """Regressions: the threads that had started waited on the queue for ever; then a
    Ctrl-C inside ``start()``, after the thread it was starting began to run, left that
    one waiting (an adversarial test's real SIGINTs hung the exit 12 times in 30)."""
    started: list[threading.Thread] = []
    real_start = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        real_start(thread)
        started.append(thread)
        if len(started) == 2:
            raise failure  # the second thread runs, but start() did not return

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(type(failure)):
        WorkerPool("test", 4)
    for thread in started:
        thread.join(5)
        assert not thread.is_alive()


def test_two_of_a_pools_threads_shutting_it_down_do_not_wait_for_each_other() -> None:
    """Regression (adversarial test): each waited for the other's thread to end, for ever
    (run in a process of its own, so that a regression fails instead of hanging)."""
    code = (
        "import asyncio, threading\n"
        "from tiered_kv.tiers._driver import WorkerPool, in_threads\n"
        "pool = WorkerPool('test', 2)\n"
        "both = threading.Barrier(2)\n"
        "def shut_down():\n"
        "    both.wait(5)\n"
        "    pool.shutdown(wait=True)\n"
        "asyncio.run(in_threads(pool, shut_down, [(), ()]))\n"
        "pool.shutdown()\n"
        "print('done')\n"
    )
    assert_runs_to_its_end(code, "done")


@st.composite
def host_buffers(draw: st.DrawFn) -> list[torch.Tensor]:
    """1-D contiguous uint8 buffers in random order: views of two slabs, views of a tensor
    whose data starts inside its storage (some reaching before it), byte views of a
    float16 tensor, and tensors of their own."""
    slabs = [torch.arange(256, dtype=torch.uint8).repeat(4) for _ in range(2)]
    inner = torch.empty(0, dtype=torch.uint8).set_(slabs[1].untyped_storage(), 512, (256,), (1,))
    wide = torch.arange(256, dtype=torch.float16)
    buffers = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["slab", "inner", "before", "wide", "own"]))
        start, n = draw(st.integers(0, 200)), draw(st.integers(1, 56))
        if kind == "slab":
            buffers.append(slabs[draw(st.integers(0, 1))][start : start + n])
        elif kind == "inner":
            buffers.append(inner[start : start + n])
        elif kind == "before":  # a view of `inner` that starts before `inner` does
            buffers.append(inner.as_strided((n,), (1,), draw(st.integers(0, 511))))
        elif kind == "wide":
            buffers.append(wide.view(torch.uint8)[start : start + n])
        else:
            buffers.append(torch.arange(n, dtype=torch.uint8))
    return buffers


@settings(max_examples=200, deadline=None)
@given(buffers=host_buffers())
def test_the_bytes_of_each_buffer_are_its_own_and_writable(buffers: list[torch.Tensor]) -> None:
    """Randomized: whether a buffer's bytes come sliced from its base's or on their own,
    they are exactly the buffer's, and writing them writes the buffer."""
    views = bytes_of_each(buffers)
    assert len(views) == len(buffers)
    for buffer, view in zip(buffers, views, strict=True):
        assert bytes(view) == buffer.numpy().tobytes()
        view[0] = (view[0] + 1) % 256
        assert int(buffer[0]) == view[0]


@st.composite
def runs_of_slots(draw: st.DrawFn) -> dict[str, Any]:
    room = draw(st.sampled_from([1, 100, 4096, 5000]))
    n = draw(st.integers(1, 6))
    return {
        "room": room,
        "payloads": [draw(st.binary(min_size=1, max_size=room)) for _ in range(n)],
        "keys": [draw(st.binary(min_size=0, max_size=MAX_KEY_BYTES)) for _ in range(n)],
        "first": draw(st.one_of(st.integers(0, 2**40), st.integers(2**63 - 6, 2**63 - 1))),
        "fingerprint": draw(st.binary(min_size=32, max_size=32)),
        "at": draw(st.integers(0, 3)) * 512,
    }


@pytest.mark.skipif(not PACKED_IN_C, reason="the xxhash package's module does not export XXH3")
@settings(max_examples=150, deadline=None)
@given(run=runs_of_slots())
def test_a_run_written_in_c_is_the_bytes_python_packs(run: dict[str, Any], tmp_path_factory: Any) -> None:
    """Randomized: each slot of a run packed and written in C is ``pack_header``'s header,
    zeros to the end of its block, the payload and, but for the last, zeros to the end of
    the slot; the run starts where it was asked to."""
    room, payloads, keys = run["room"], run["payloads"], run["keys"]
    headers = memoryview(mmap.mmap(-1, HEADER_BYTES * len(payloads)))
    headers[:] = b"\xff" * len(headers)  # what earlier runs left
    zeros = memoryview(bytes(room))
    path = tmp_path_factory.mktemp("run") / "slots"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        views = [memoryview(payload) for payload in payloads]
        done, asked = _slotwrite.write_run(
            fd, run["at"], headers, views, keys, run["first"], run["fingerprint"], zeros, room
        )
    finally:
        os.close(fd)
    expected = b""
    for i, (payload, key) in enumerate(zip(payloads, keys, strict=True)):
        header = pack_header(
            fingerprint=run["fingerprint"],
            slot=run["first"] + i,
            key=key,
            length=len(payload),
            checksum=payload_checksum(memoryview(payload)),
        )
        expected += header + bytes(HEADER_BYTES - len(header)) + payload
        if i < len(payloads) - 1:
            expected += bytes(room - len(payload))
    assert done == asked == len(expected)
    assert path.read_bytes() == bytes(run["at"]) + expected


@pytest.mark.skipif(not PACKED_IN_C, reason="the xxhash package's module does not export XXH3")
def test_a_run_in_c_refuses_what_is_not_a_run_of_slots(tmp_path: Path) -> None:
    headers = memoryview(mmap.mmap(-1, 2 * HEADER_BYTES))
    fingerprint, zeros = bytes(32), memoryview(bytes(64))
    fd = os.open(tmp_path / "slots", os.O_RDWR | os.O_CREAT)
    try:
        payload = memoryview(bytes(64))
        for bad in (
            (fd, 0, headers, [], [], 0, fingerprint, zeros, 64),  # no slot
            (fd, 0, headers, [payload], [b"k", b"k"], 0, fingerprint, zeros, 64),  # keys and payloads apart
            (fd, 0, headers, [payload] * 3, [b"k"] * 3, 0, fingerprint, zeros, 64),  # headers too short
            (fd, 0, headers, [payload], [b"k" * (MAX_KEY_BYTES + 1)], 0, fingerprint, zeros, 64),
            (fd, 0, headers, [payload], [b"k"], 0, bytes(16), zeros, 64),  # not a fingerprint
            (fd, 0, headers, [payload], [b"k"], 0, fingerprint, zeros, 32),  # longer than a slot
            (fd, 0, headers, [payload], [b"k"], -1, fingerprint, zeros, 64),
        ):
            with pytest.raises(ValueError):
                _slotwrite.write_run(*bad)
    finally:
        os.close(fd)
    with pytest.raises(OSError) as caught:
        _slotwrite.write_run(fd, 0, headers, [payload], [b"k"], 0, fingerprint, zeros, 64)  # closed
    assert caught.value.errno == errno.EBADF


@pytest.mark.skipif(not PACKED_IN_C, reason="the xxhash package's module does not export XXH3")
def test_a_bind_that_finds_no_xxhash_leaves_runs_unwritable_until_one_does(tmp_path: Path) -> None:
    """A failed bind forgets the functions an earlier one found (and keeps its format):
    nothing is written with hashes it did not find."""
    spec = importlib.util.find_spec("xxhash._xxhash")
    assert spec is not None and spec.origin is not None
    args = (0, memoryview(mmap.mmap(-1, HEADER_BYTES)), [memoryview(b"x")], [b"k"], 0, bytes(32), memoryview(b"\0"), 1)
    try:
        assert not _slotwrite.bind(str(tmp_path / "no-such-library.so"), b"WRONGMAG", 9)
        fd = os.open(tmp_path / "slots", os.O_RDWR | os.O_CREAT)
        try:
            with pytest.raises(RuntimeError, match="bind"):
                _slotwrite.write_run(fd, *args)
        finally:
            os.close(fd)
    finally:
        assert _slotwrite.bind(spec.origin, MAGIC, FORMAT_VERSION)


def test_checking_a_host_buffer_asks_nothing_that_gives_up_the_interpreter_lock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The event loop checks every op's buffer. A tensor method that gives up the
    interpreter lock (measured: ``is_neg()``, ``numpy()``, ``view``, ``as_strided``; not
    the attributes and ``is_contiguous()``, ``numel()``) would hand it to a worker thread
    waiting for it, and the loop would wait for that thread's Python."""

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a call that gives up the interpreter lock")

    for method in ("is_neg", "numpy", "view", "as_strided", "contiguous"):
        monkeypatch.setattr(torch.Tensor, method, refused)
    assert check_buffer(torch.zeros(8192, dtype=torch.uint8)[4096:], max_bytes=4096, exact=True) == 4096

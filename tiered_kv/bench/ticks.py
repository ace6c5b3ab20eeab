"""Event-loop stalls as the bench measures them, in this process and in a bystander.

A ticker sleeps ``TICK_S`` at a time; a stall is how much later than asked it wakes.

A stall in the measured loop has two parts: what the library does on that loop, and what
the machine does to any loop while the measured load runs (other threads and the kernel's
I/O taking the CPUs, a hypervisor pausing them). The :class:`Bystander` measures the
second part alone: a ticker in a process of its own, which holds no interpreter lock,
heap or task of the measured one, runs beside a measurement, so that its stalls are
those the machine gave a loop that did nothing. A stall in the measured loop that the
bystander saw at the same time too was not the library's doing.

Run as ``python -m tiered_kv.bench.ticks``, this module is the bystander: it ticks
until its standard input ends and answers each line ``take`` with one JSON line,
``[max, p99]`` in ms of the stalls since the previous ``take``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from tiered_kv import _counterfd

TICK_S = 0.001
#: How long the bystander may take to answer ``take`` or to end before it is given up.
ANSWER_S = 30.0


async def tick(lates: list[float]) -> None:
    """Forever: sleep ``TICK_S`` and append to ``lates`` how late (in seconds) it woke."""
    clock = time.perf_counter
    while True:
        started = clock()
        await asyncio.sleep(TICK_S)
        lates.append(clock() - started - TICK_S)


def worst(lates: list[float]) -> tuple[float, float]:
    """``(max, p99)`` of ``lates``, in ms; 0 when there are none."""
    if len(lates) < 2:
        top = max(lates, default=0.0) * 1e3
        return top, top
    return max(lates) * 1e3, statistics.quantiles(lates, n=100, method="inclusive")[98] * 1e3


class KernelTicker:
    """A ticker whose ticks the kernel times: a Linux ``timerfd`` firing every ``TICK_S``,
    watched by the loop. A stall is how much later than the tick the loop runs its
    callback, as it would for a socket that became readable then.

    A sleep's wake-up is timed by the loop's selector, whose wait ``epoll`` rounds up to
    the next whole millisecond: once anything else woke the loop (an I/O completion, a
    packet), the rest of a 1 ms sleep is waited as 1 ms, and the sleep wakes up to 1 ms
    late with no callback running at all. This ticker's figures leave that rounding out;
    the sleep's keep it, as any timer of the host has it. Each wake-up counts once, from
    the earliest tick it found pending (a stall of 30 ms is one stall of 30 ms)."""

    def __init__(self) -> None:
        self._fd = -1
        self._first = 0.0
        self._seen = 0
        self._lates: list[float] = []

    @staticmethod
    def available() -> bool:
        return _timerfd() is not None

    @contextlib.contextmanager
    def running(self) -> Iterator[KernelTicker]:
        """Tick while the body runs (on the running loop); ``OSError`` where the system has
        no timerfd (see :meth:`available`)."""
        libc = _timerfd()
        if libc is None:
            raise OSError(errno.ENOSYS, "no timerfd on this system")
        loop = asyncio.get_running_loop()
        fd = libc.timerfd_create(time.CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create")
        try:
            self._fd, self._seen, self._lates = fd, 0, []
            self._first = time.clock_gettime(time.CLOCK_MONOTONIC) + TICK_S
            period = _timespec(0, int(TICK_S * 1e9))
            first = _timespec(int(self._first), int(self._first % 1 * 1e9))
            if libc.timerfd_settime(fd, _TFD_TIMER_ABSTIME, ctypes.byref(_itimerspec(period, first)), None) < 0:
                raise OSError(ctypes.get_errno(), "timerfd_settime")
            loop.add_reader(fd, self._fired)
            try:
                yield self
            finally:
                loop.remove_reader(fd)
        finally:
            os.close(fd)
            self._fd = -1

    def _fired(self) -> None:
        now = time.clock_gettime(time.CLOCK_MONOTONIC)
        # Read keeping the interpreter lock: os.read gives it up, and the loop would then
        # wait for worker threads to give it back, a stall of the ticker's own making.
        count = _counterfd.take(self._fd)
        if not count:  # read already (a spurious wake-up)
            return
        self._lates.append(now - (self._first + self._seen * TICK_S))  # from the earliest pending tick
        self._seen += count

    def take(self) -> tuple[float, float]:
        """``(max, p99)`` stall in ms since the last take."""
        taken, self._lates = self._lates, []
        return worst(taken)


class _timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _timespec), ("it_value", _timespec)]


_TFD_TIMER_ABSTIME = 1


@functools.cache
def _timerfd() -> Any:
    """The C library, where it has ``timerfd_create`` (Linux); else ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    return libc if hasattr(libc, "timerfd_create") and hasattr(libc, "timerfd_settime") else None


class BystanderError(RuntimeError):
    """The bystander process ended or stopped answering."""


class Bystander:
    """A ticker in another process (this interpreter, this module), started by
    :meth:`running`; :meth:`take` gives its ``(max, p99)`` stall since the last take."""

    def __init__(self) -> None:
        self._process: asyncio.subprocess.Process | None = None

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Bystander]:
        self._process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            __name__,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            await self.take()  # it is ticking once it answers
            yield self
        finally:
            await self._stop()

    @property
    def pid(self) -> int:
        assert self._process is not None, "not running"
        return self._process.pid

    async def take(self) -> tuple[float, float]:
        process = self._process
        assert process is not None and process.stdin is not None and process.stdout is not None, "not running"
        try:
            process.stdin.write(b"take\n")
            await process.stdin.drain()
            line = await asyncio.wait_for(process.stdout.readline(), ANSWER_S)
        except TimeoutError as exc:
            raise BystanderError(f"the bystander process {process.pid} stopped answering for {ANSWER_S} s") from exc
        except OSError:  # its end of the pipe is closed: it has ended
            line = b""
        if not line:
            status = await asyncio.wait_for(process.wait(), ANSWER_S)
            raise BystanderError(f"the bystander process {process.pid} ended (exit status {status})")
        stall_max, stall_p99 = json.loads(line)
        return float(stall_max), float(stall_p99)

    async def _stop(self) -> None:
        """End the process, however :meth:`running`'s body ended (a cancellation too)."""
        process, self._process = self._process, None
        assert process is not None and process.stdin is not None
        with contextlib.suppress(OSError):
            process.stdin.close()
        try:
            await asyncio.wait_for(asyncio.shield(process.wait()), ANSWER_S)
        finally:
            if process.returncode is None:
                process.kill()
                await asyncio.shield(process.wait())


async def _serve() -> None:
    """The bystander: tick; answer ``take``; end with standard input."""
    loop = asyncio.get_running_loop()
    lates: list[float] = []
    ticker = asyncio.ensure_future(tick(lates))
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while (line := await reader.readline()) == b"take\n":
            await asyncio.sleep(TICK_S)  # a wake-up the machine delayed is counted once it has run
            taken, lates[:] = lates[:], []
            sys.stdout.write(json.dumps(worst(taken)) + "\n")
            sys.stdout.flush()
        if line:
            raise SystemExit(f"unexpected input {line[:40]!r}")
    finally:
        ticker.cancel()


if __name__ == "__main__":
    asyncio.run(_serve())

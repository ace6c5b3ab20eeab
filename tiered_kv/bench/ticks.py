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
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator

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

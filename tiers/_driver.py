"""What every driver in this package shares: op checks, worker pools, and waiting out
worker threads when the awaiting task is cancelled (identity and counters are the core's
:class:`tiered_kv.driver_base.DriverBase`).

Copies and file I/O run in worker threads so the event loop stays responsive. A thread
cannot be stopped half-way, so a cancelled driver call waits for its threads to let go of
the buffers before it lets ``CancelledError`` through: the protocol promises the caller
may free the buffers as soon as the call returns or raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar, cast

from tiered_kv.errors import TierError, TierFullError, TierIOError
from tiered_kv.interfaces import TransferOp
from tiered_kv.scheduler import wait_out

if TYPE_CHECKING:  # torch is imported where it is used: `tiered-kv inspect` runs without it
    import torch

T = TypeVar("T")

#: Alignment of slots in memory and on disk: a page, which satisfies ``O_DIRECT`` on every
#: Linux filesystem.
PAGE = 4096

#: How long a driver thread steps aside between steps of work that holds the interpreter
#: lock (see :func:`hand_over`).
HAND_OVER_S = 1e-4

#: errno values that mean "the medium has no room left".
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


async def settle(future: asyncio.Future[T], abort: Callable[[], object] | None = None) -> T:
    """Await ``future``; if the awaiting task is cancelled, let ``future`` finish first.

    ``future`` stands for work that cannot be interrupted once it runs (a worker thread,
    a GPU copy). On cancellation ``abort`` is called to drop the work if it has not
    started yet; otherwise the cancellation is held back until the work is done.
    """
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        if abort is not None:
            abort()
        await wait_out([future])  # cancelled again: still waits; the cancellation is re-raised below
        if not future.cancelled():
            future.exception()  # retrieved: the cancellation is what the caller hears about
        raise


def hand_over() -> None:
    """In a driver thread, between steps of work that holds the interpreter lock (loops of
    Python-level calls over a whole slot map): let the event loop's thread take the lock.

    Without it the loop's thread waits for the interpreter's switch interval (5 ms) at
    each step: a warm restart of a million chunks held it back that long, tens of times
    over. Merely releasing the lock does not help, since the releasing thread usually
    takes it back before the waiting one wakes; sleeping a moment lets the waiter in."""
    time.sleep(HAND_OVER_S)


def round_up(n: int, align: int = PAGE) -> int:
    return -(-n // align) * align


#: Copy threads of a CPU-memory driver: the parallelism a ``torch`` copy would have had.
COPY_WORKERS = max(1, min(4, os.cpu_count() or 1))


#: Bytes of copying or I/O worth a thread of its own: below it, the hand-off to another
#: thread (a wake-up and a turn of the GIL against a busy event loop) costs more than the
#: work it would take over.
BYTES_PER_THREAD = 1 << 20


def thread_parts(nbytes: int, workers: int) -> int:
    """Threads to share a call's ``nbytes``: one per ``BYTES_PER_THREAD``, at most ``workers``."""
    return min(workers, max(1, nbytes // BYTES_PER_THREAD))


def outside(slot: int, num_slots: int) -> bool:
    """Whether ``slot`` is not a slot number of a tier of ``num_slots`` (a ``bool`` is not one)."""
    return type(slot) is bool or not 0 <= slot < num_slots


def split(ops: Sequence[T], parts: int) -> list[Sequence[T]]:
    """``ops`` cut into at most ``parts`` non-empty runs of near-equal length.

    Runs, not round-robin: two threads writing alternate neighbouring slots measured
    ~15% slower than each writing its own half.
    """
    parts = min(parts, len(ops))
    if not parts:
        return []
    bounds = [len(ops) * i // parts for i in range(parts + 1)]
    return [ops[a:b] for a, b in itertools.pairwise(bounds)]


def worker_pool(name: str, workers: int) -> ThreadPoolExecutor:
    """Threads for a driver's copies and I/O, each limited to one torch intra-op thread.

    A thread that runs torch CPU ops with the default thread count gets its own OpenMP
    team; two teams oversubscribe the cores, after which libgomp stops spin-waiting and
    every parallel region in the process (the engine's included) pays a wake-up. Drivers
    get their parallelism from several workers instead.
    """
    import torch

    return ThreadPoolExecutor(
        workers, thread_name_prefix=f"tiered-kv-{name}", initializer=torch.set_num_threads, initargs=(1,)
    )


class _Calls:
    """Calls running in worker threads and what they returned or raised.

    Each call is counted finished on the loop once (one ``call_soon_threadsafe``): when it
    has run, or when its future ended without running it (cancelled, or failed by the
    executor: shut down with ``cancel_futures``, a broken pool). The awaiting task wakes
    once the last one is counted. A call can also be dropped from the loop before it
    begins (its submission failed after the executor had queued it); if it has begun, it
    reports itself.
    """

    __slots__ = ("_counted", "_dropped", "_left", "_lock", "_loop", "_started", "_waiter", "errors", "results")

    def __init__(self, loop: asyncio.AbstractEventLoop, n: int) -> None:
        self._loop = loop
        self._left = n
        self._waiter: asyncio.Future[None] | None = None
        self._lock = threading.Lock()
        self._started = [False] * n  # under _lock
        self._dropped = [False] * n  # under _lock
        self._counted = [False] * n  # on the loop
        self.results: list[object] = [None] * n
        self.errors: list[BaseException | None] = [None] * n

    def run(self, i: int, fn: Callable[..., object], args: tuple[object, ...]) -> None:
        """In a worker thread: call ``i``, unless it was dropped."""
        with self._lock:
            if self._dropped[i]:
                return
            self._started[i] = True
        try:
            self.results[i] = fn(*args)
        except BaseException as exc:  # handed to the awaiting task
            self.errors[i] = exc
        finally:
            self._report(i)

    def ended(self, i: int, job: Future[None]) -> None:
        """Call ``i``'s future is done (in whichever thread completed it). If the call
        never ran, nothing else reports it, and the executor's reason is its error."""
        with self._lock:
            started = self._started[i]
        if started:
            return
        if job.cancelled():  # by the caller's cancellation, or by the executor shutting down
            self.errors[i] = RuntimeError("the executor cancelled the call before it ran")
        else:
            self.errors[i] = job.exception()  # a broken pool; None: dropped, counted already
        self._report(i)

    def _report(self, i: int) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody awaits this
            self._loop.call_soon_threadsafe(self.finished, i)

    def drop(self, i: int) -> None:
        """On the loop: call ``i`` must not begin; if it has, it reports when it ends."""
        with self._lock:
            if self._started[i]:
                return
            self._dropped[i] = True
        self.finished(i)

    def finished(self, i: int) -> None:
        """On the loop: call ``i`` finished, or will never run."""
        if self._counted[i]:
            return
        self._counted[i] = True
        self._left -= 1
        if not self._left and self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> None:
        """Until every call has finished."""
        if self._left:
            self._waiter = self._loop.create_future()
            await self._waiter

    async def wait_out(self) -> bool:
        """:meth:`wait` that a cancellation does not cut short; whether one came (it is the
        caller's to raise)."""
        cancelled = False
        while self._left:
            try:
                await self.wait()
            except asyncio.CancelledError:
                cancelled = True
        return cancelled


async def in_threads(executor: Executor, fn: Callable[..., T], calls: Sequence[tuple[object, ...]]) -> list[T]:
    """Run ``fn(*args)`` for each ``args`` of ``calls`` in ``executor``; wait for them all.

    Returns the results in order, or raises the first call's error once every call has
    finished. Cancellation-safe (as :func:`settle`): calls not yet started are dropped and
    the cancellation waits for those running. A submission the executor refuses raises
    once the calls already submitted have finished (or, if the task was cancelled
    meanwhile, the cancellation does). The awaiting task resumes one loop iteration after
    the last call finishes (no futures chained in between: under load each iteration of a
    busy loop is a wait for every task ready in it).
    """
    if not calls:
        return []
    batch = _Calls(asyncio.get_running_loop(), len(calls))
    jobs: list[Future[None]] = []
    try:
        for i, args in enumerate(calls):
            job = executor.submit(batch.run, i, fn, args)
            job.add_done_callback(functools.partial(batch.ended, i))
            jobs.append(job)
    except BaseException as exc:
        for i in range(len(jobs), len(calls)):  # not submitted, or queued by a submit that then failed
            batch.drop(i)
        if await batch.wait_out():
            raise asyncio.CancelledError from exc
        raise
    try:
        await batch.wait()
    except asyncio.CancelledError:
        for job in jobs:
            job.cancel()  # one not started never runs; its future reports it
        await batch.wait_out()
        raise
    first = next((error for error in batch.errors if error is not None), None)
    if first is not None:
        raise first
    return cast("list[T]", batch.results)


async def shutdown(executor: Executor) -> None:
    """Shut ``executor`` down after the work already submitted to it has finished."""
    await settle(asyncio.get_running_loop().run_in_executor(None, executor.shutdown))


def tier_error(tier: str, what: str, exc: BaseException) -> TierError:
    """The typed error for a native failure: ``ENOSPC``-like errors mean the tier is full."""
    if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
        return TierFullError(f"{what}: {exc}", tier=tier)
    return TierIOError(f"{what}: {exc}", tier=tier)


def check_buffer(buffer: torch.Tensor, *, max_bytes: int, exact: bool = False) -> int:
    """Bytes of a host buffer that is 1-D, contiguous, ``uint8`` and on the CPU."""
    import torch

    if buffer.dtype is not torch.uint8 or not buffer.is_cpu or buffer.ndim != 1 or not buffer.is_contiguous():
        raise ValueError(
            f"a host buffer is a 1-D contiguous uint8 CPU tensor, got {buffer.dtype} "
            f"{list(buffer.shape)} on {buffer.device}"
        )
    nbytes = buffer.numel()
    if nbytes > max_bytes or (exact and nbytes != max_bytes) or nbytes == 0:
        wanted = f"exactly {max_bytes}" if exact else f"1 to {max_bytes}"
        raise ValueError(f"a host buffer of {nbytes} bytes; this tier takes {wanted}")
    return nbytes


def bytes_of(buffer: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous uint8 CPU tensor's bytes (zero-copy)."""
    return buffer.numpy().data.cast("B")


def check_slots(ops: Sequence[TransferOp], num_slots: int) -> None:
    """Every op names a slot of the tier, and no two ops of a batch name the same one."""
    slots = [op.slot for op in ops]
    bad = [slot for slot in slots if outside(slot, num_slots)]
    if bad:
        raise ValueError(f"slot {bad[0]} is outside this tier's {num_slots} slots")
    if len(set(slots)) != len(slots):
        raise ValueError("a batch names the same slot twice")

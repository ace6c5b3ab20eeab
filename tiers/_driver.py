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
import errno
import itertools
import os
import queue
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar, cast

from tiered_kv.errors import TierError, TierFullError, TierIOError
from tiered_kv.interfaces import TransferOp
from tiered_kv.scheduler import wait_out
from tiered_kv.tiers._completions import completions

if TYPE_CHECKING:  # torch is imported where it is used: `tiered-kv inspect` runs without it
    import torch

T = TypeVar("T")

#: Alignment of slots in memory and on disk: a page, which satisfies ``O_DIRECT`` on every
#: Linux filesystem.
PAGE = 4096

#: How long a driver thread steps aside between steps of work that holds the interpreter
#: lock (see :func:`hand_over`).
HAND_OVER_S = 1e-4
#: How much such work a driver thread does between two hand-overs: each costs it a sleep
#: of 0.1-0.3 ms, and the loop's thread waits for the lock up to about this long.
HAND_OVER_EVERY_S = 1e-3

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


async def see_through(steps: Iterable[Callable[[], Awaitable[object]]]) -> None:
    """Await each of ``steps`` in turn, a cancellation meanwhile cutting none of them
    short (each step sees its own wait through, as :func:`settle` does) and none of the
    rest skipped; the cancellation is raised once the last step is done. For a driver's
    ``close``, which a host's cancel-all cancels with everything else."""
    cancelled = False
    for step in steps:
        try:
            await step()
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


def hand_over() -> None:
    """In a driver thread, between steps of work that holds the interpreter lock (loops of
    Python-level calls over a whole slot map): let the event loop's thread take the lock.

    Without it the loop's thread waits for the interpreter's switch interval (5 ms) at
    each step: a warm restart of a million chunks held it back that long, tens of times
    over. Merely releasing the lock does not help, since the releasing thread usually
    takes it back before the waiting one wakes; sleeping a moment lets the waiter in."""
    time.sleep(HAND_OVER_S)


class Pacer:
    """:func:`hand_over` once about ``HAND_OVER_EVERY_S`` of work has run since the last:
    call :meth:`step` between the steps of a long computation in a driver thread (parsing
    or folding a slot map of a million entries), however long each step is."""

    __slots__ = ("_due",)

    def __init__(self) -> None:
        self._due = time.perf_counter() + HAND_OVER_EVERY_S

    def step(self) -> None:
        if time.perf_counter() >= self._due:
            hand_over()
            self._due = time.perf_counter() + HAND_OVER_EVERY_S


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


#: A call queued for a worker thread: ``batch.run(i, fn, args)``.
_Call = tuple["_Calls", int, Callable[..., object], tuple[object, ...]]


class WorkerPool:
    """A driver's worker threads, fed from one queue.

    What :class:`concurrent.futures.ThreadPoolExecutor` does for a driver, without what a
    driver does not use: a submission is one queue put (about 0.2 µs on the event loop,
    against 14 µs for the executor's ``submit`` with its future, condition, semaphore and
    done callback), and a finished call costs its thread no future to complete. Calls run
    in submission order. :func:`in_threads` keeps the books of what ran.

    :meth:`shutdown` lets the calls already queued run, then ends the threads; a pool
    dropped without it ends them too, and so does the interpreter's exit, before it waits
    for its threads (as the executor does).
    """

    __slots__ = ("__weakref__", "_closed", "_lock", "_queue", "_threads", "name")

    def __init__(self, name: str, workers: int, *, init: Callable[[], object] | None = None) -> None:
        if workers <= 0:
            raise ValueError(f"workers must be positive, got {workers}")
        self.name = name
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [
            threading.Thread(target=_work, args=(self._queue, init), name=f"tiered-kv-{name}_{i}")
            for i in range(workers)
        ]
        try:
            for thread in self._threads:
                thread.start()
        except BaseException:  # no thread for one of them, or Ctrl-C: end those that run
            _stop(self._queue, workers)  # a stop each (one interrupted in start() may run)
            raise
        weakref.finalize(self, _stop, self._queue, workers)  # dropped unclosed: end the threads
        _POOLS.add(self)

    def __repr__(self) -> str:
        return f"<WorkerPool {self.name} threads={len(self._threads)} closed={self._closed}>"

    def submit(self, call: _Call) -> None:
        """Queue ``call`` for a worker thread; ``RuntimeError`` once the pool is shut down."""
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new calls after shutdown")
            self._queue.put(call)

    def shutdown(self, wait: bool = True) -> None:
        """Take no more calls; the threads end once the calls queued have run (``wait``:
        return only then, unless called from one of the pool's own threads, which cannot
        wait for themselves or for each other)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                _stop(self._queue, len(self._threads))
        if wait and threading.current_thread() not in self._threads:
            for thread in self._threads:
                thread.join()


def _work(calls: queue.SimpleQueue[_Call | None], init: Callable[[], object] | None) -> None:
    """A worker thread: run calls until the queue says stop (it holds no reference to its
    pool). If ``init`` fails, every call the thread takes fails with that reason: queued
    calls are never left waiting for a thread that is gone."""
    failed: BaseException | None = None
    if init is not None:
        try:
            init()
        except BaseException as exc:  # reported to each call's caller
            failed = exc
    while (call := calls.get()) is not None:
        batch, i, fn, args = call
        if failed is None:
            batch.run(i, fn, args)
        else:
            batch.run(i, _cannot_start, (failed,))
        del call, batch, fn, args  # no reference to a finished call while waiting for the next


def _cannot_start(reason: BaseException) -> None:
    raise RuntimeError(f"the worker thread could not start: {reason!r}") from reason


def _stop(calls: queue.SimpleQueue[_Call | None], threads: int) -> None:
    for _ in range(threads):
        calls.put(None)


#: Pools not yet shut down, ended at the interpreter's exit.
_POOLS: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


def _shut_down_pools() -> None:
    for pool in list(_POOLS):
        pool.shutdown(wait=True)


# The hook concurrent.futures uses for its executors: it runs before the interpreter waits
# for its threads, which would otherwise wait for ever for a pool nobody shut down.
getattr(threading, "_register_atexit")(_shut_down_pools)  # noqa: B009


def _one_torch_thread() -> None:
    import torch

    torch.set_num_threads(1)


def worker_pool(name: str, workers: int) -> WorkerPool:
    """Threads for a driver's copies and I/O, each limited to one torch intra-op thread.

    A thread that runs torch CPU ops with the default thread count gets its own OpenMP
    team; two teams oversubscribe the cores, after which libgomp stops spin-waiting and
    every parallel region in the process (the engine's included) pays a wake-up. Drivers
    get their parallelism from several workers instead.
    """
    return WorkerPool(name, workers, init=_one_torch_thread)


async def worker_pool_off_loop(name: str, workers: int) -> WorkerPool:
    """:func:`worker_pool`, its threads started in the loop's default executor: starting a
    thread waits until it runs (about 0.25 ms each on the development VM, 2 ms for an nvme
    driver's 8), the loop's time otherwise. A caller cancelled meanwhile drops the pool,
    which ends its threads."""
    return await asyncio.to_thread(worker_pool, name, workers)


class _Calls:
    """Calls running in worker threads and what they returned or raised.

    Each call is counted finished on the loop once: when it has run (posted from its
    thread to the loop's :func:`~tiered_kv.tiers._completions.completions`), or when it is
    dropped from the loop before it begins (never submitted, or its caller was
    cancelled), after which its thread skips it. A call that has begun reports itself.
    The awaiting task wakes once the last one is counted.
    """

    __slots__ = (
        "_completions",
        "_counted",
        "_dropped",
        "_left",
        "_lock",
        "_loop",
        "_started",
        "_waiter",
        "errors",
        "results",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, n: int) -> None:
        self._loop = loop
        self._completions = completions(loop)
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
            self._completions.post(self.finished, i)

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


async def in_threads(pool: WorkerPool, fn: Callable[..., T], calls: Sequence[tuple[object, ...]]) -> list[T]:
    """Run ``fn(*args)`` for each ``args`` of ``calls`` in ``pool``; wait for them all.

    Returns the results in order, or raises the first call's error once every call has
    finished. Cancellation-safe (as :func:`settle`): calls not yet started are dropped and
    the cancellation waits for those running. A submission the pool refuses (it was shut
    down) raises once the calls already submitted have finished (or, if the task was
    cancelled meanwhile, the cancellation does). The awaiting task resumes one loop
    iteration after the last call finishes (no futures chained in between: under load
    each iteration of a busy loop is a wait for every task ready in it).
    """
    if not calls:
        return []
    batch = _Calls(asyncio.get_running_loop(), len(calls))
    submitted = 0
    try:
        for i, args in enumerate(calls):
            pool.submit((batch, i, fn, args))
            submitted += 1
    except BaseException as exc:
        for i in range(submitted, len(calls)):
            batch.drop(i)
        if await batch.wait_out():
            raise asyncio.CancelledError from exc
        raise
    try:
        await batch.wait()
    except asyncio.CancelledError:
        for i in range(len(calls)):
            batch.drop(i)  # one not started never runs; one running reports when it ends
        await batch.wait_out()
        raise
    first = next((error for error in batch.errors if error is not None), None)
    if first is not None:
        raise first
    return cast("list[T]", batch.results)


async def off_loop(fn: Callable[..., object], *args: object) -> None:
    """``fn(*args)`` in the loop's default executor, awaited as :func:`settle` awaits: a
    step of a driver's ``open`` or ``close`` that takes time and must not be left half done."""
    await settle(asyncio.get_running_loop().run_in_executor(None, fn, *args))


async def shutdown(pool: WorkerPool) -> None:
    """Shut ``pool`` down after the work already submitted to it has finished."""
    await off_loop(pool.shutdown)


def tier_error(tier: str, what: str, exc: BaseException) -> TierError:
    """The typed error for a native failure: ``ENOSPC``-like errors mean the tier is full."""
    if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
        return TierFullError(f"{what}: {exc}", tier=tier)
    return TierIOError(f"{what}: {exc}", tier=tier)


def check_buffer(buffer: torch.Tensor, *, max_bytes: int, exact: bool = False) -> int:
    """Bytes of a host buffer that is 1-D, contiguous, ``uint8`` and on the CPU. On every
    op of the event loop's calls: it asks nothing that gives up the interpreter lock
    (``is_neg()`` does; :func:`bytes_of_each` asks it another way, in a worker thread)."""
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


def bytes_of_each(buffers: Iterable[torch.Tensor]) -> list[memoryview]:
    """:func:`bytes_of` of each of ``buffers`` (each checked as :func:`check_buffer` does);
    :class:`ValueError` for a negated view, whose values are not its bytes.

    For a worker thread: buffers that are views of one contiguous ``uint8`` base tensor (a
    cpu tier's slot views) become slices of one view of the base's bytes. Each ``numpy()``
    gives up the interpreter lock, and a worker thread that gives it up while the event
    loop runs waits for the loop's next turn to have it back: a view per buffer made a
    write of 32 chunks wait for the loop up to 32 times. (So does ``Tensor.is_neg()``;
    ``torch.is_neg`` does not.)
    """
    import torch

    views: list[memoryview] = []
    last_base: torch.Tensor | None = None
    whole, start = memoryview(b""), 0
    for buffer in buffers:
        if torch.is_neg(buffer):
            raise ValueError("a host buffer's values are its bytes: this one is a negated view")
        base = buffer._base
        if base is not None and base is not last_base:
            last_base = base
            whole, start = _bytes_of_base(base)
        at = buffer.data_ptr() - start
        n = buffer.numel()
        views.append(whole[at : at + n] if base is not None and 0 <= at <= len(whole) - n else bytes_of(buffer))
    return views


def _bytes_of_base(base: torch.Tensor) -> tuple[memoryview, int]:
    """A base tensor's bytes and their address; none where it is not contiguous ``uint8``
    on the CPU (its views then take :func:`bytes_of` each)."""
    import torch

    if base.dtype is not torch.uint8 or not base.is_cpu or not base.is_contiguous():
        return memoryview(b""), 0
    return bytes_of(base.view(-1)), base.data_ptr()


def check_slots(ops: Sequence[TransferOp], num_slots: int) -> None:
    """Every op names a slot of the tier, and no two ops of a batch name the same one."""
    slots = [op.slot for op in ops]
    bad = [slot for slot in slots if outside(slot, num_slots)]
    if bad:
        raise ValueError(f"slot {bad[0]} is outside this tier's {num_slots} slots")
    if len(set(slots)) != len(slots):
        raise ValueError("a batch names the same slot twice")

"""The asyncio side of tiered-kv: every background task, bound and priority in one place.

* :class:`PriorityGate` limits concurrent copy jobs; waiting loads go before waiting
  stores, because a load is on some request's time-to-first-token and a store is not.
* :class:`Budget` bounds how much work producers may submit (backpressure), with a
  ``*_nowait`` twin that raises :class:`BusyError` instead of waiting.
* :class:`Scheduler` owns background tasks, shares one in-flight job between callers that
  need the same thing (two loads of the same chunk from nvme share one read), and keeps
  the first unexpected error of a background task to raise to the owner.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import functools
import heapq
import itertools
from collections.abc import Callable, Coroutine, Generator, Hashable, Iterable
from types import FrameType
from typing import Any, TypeVar

from tiered_kv.checks import is_int_at_least
from tiered_kv.errors import BusyError, ConfigError, TieredKVError
from tiered_kv.log import get_logger

T = TypeVar("T")
log = get_logger("scheduler")

LOAD_PRIORITY = 0
STORE_PRIORITY = 1


class PriorityGate:
    """At most ``limit`` holders at once; the lowest priority number is admitted first.

    A waiter cancelled before it is admitted leaves its future cancelled in the heap; it is
    skipped when popped. Whoever leaves the gate, or gives up waiting, admits the next live
    waiters at once, so the gate is never idle while someone waits.
    """

    def __init__(self, limit: int) -> None:
        if not is_int_at_least(limit, 1):
            raise ConfigError(f"must be a positive integer, got {limit!r}", field="limit")
        self.limit = limit
        self.holders = 0
        #: Waiters by priority; a cancelled one stays in the heap until it is popped.
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        #: Waiters not yet admitted whose tasks have not given up (cancelled ones included
        #: until their task runs again and leaves).
        self.waiting = 0
        self._seq = itertools.count()

    def hold(self, priority: int) -> _Hold:
        """``async with gate.hold(priority):`` — hold a place for the block."""
        return _Hold(self, priority)

    async def _acquire(self, priority: int) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (priority, next(self._seq), fut))
        self.waiting += 1
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self._release()  # admitted and cancelled in the same step: hand the place on
            else:
                fut.cancel()
                self.waiting -= 1
                self._admit()  # a place may have been freed while this waiter was leaving
            raise

    def _release(self) -> None:
        self.holders -= 1
        self._admit()

    def _admit(self) -> None:
        while self._waiters and self.holders < self.limit:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():
                self.holders += 1
                self.waiting -= 1
                fut.set_result(None)


class _Hold:
    """One place at a :class:`PriorityGate`, taken without waiting when one is free."""

    __slots__ = ("_gate", "_priority")

    def __init__(self, gate: PriorityGate, priority: int) -> None:
        self._gate = gate
        self._priority = priority

    async def __aenter__(self) -> None:
        gate = self._gate
        if gate.holders < gate.limit and not gate.waiting:
            gate.holders += 1
        else:
            await gate._acquire(self._priority)

    async def __aexit__(self, *exc: object) -> None:
        self._gate._release()


class Budget:
    """A bounded amount (chunks, bytes) that producers take and workers give back.

    Waiters are served first come, first served, so a large request is not starved by a
    stream of small ones. A waiter cancelled before it is granted is skipped.
    """

    def __init__(self, limit: int, what: str) -> None:
        if not is_int_at_least(limit, 1):
            raise ConfigError(f"must be a positive integer, got {limit!r}", field=what)
        self.limit = limit
        self.what = what
        self.used = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    def take_nowait(self, n: int) -> None:
        """Take ``n`` now or raise :class:`BusyError`. A request larger than the whole
        budget is admitted alone so that it can never wait forever."""
        if self._waiters or not self._fits(n):
            raise BusyError(f"{self.what}: {self.used}/{self.limit} in use, {n} more requested")
        self.used += n

    async def take(self, n: int) -> None:
        if not self._waiters and self._fits(n):
            self.used += n
            return
        waiter = (n, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        try:
            await waiter[1]
        except BaseException:
            if waiter[1].done() and not waiter[1].cancelled():
                self.give(n)  # granted and cancelled in the same step
            else:
                waiter[1].cancel()
                with contextlib.suppress(ValueError):  # already skipped by a wake-up
                    self._waiters.remove(waiter)
                self._wake()
            raise

    def _fits(self, n: int) -> bool:
        return self.used + n <= self.limit or self.used == 0

    def give(self, n: int) -> None:
        if n > self.used:
            raise TieredKVError(f"{self.what}: gave back {n} but only {self.used} were taken")
        self.used -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.done():  # cancelled, its task not yet run: skip it
                self._waiters.popleft()
                continue
            if not self._fits(n):
                return
            self._waiters.popleft()
            self.used += n
            fut.set_result(None)


class Scheduler:
    """Owns background tasks; shares in-flight jobs; remembers the first fatal error."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._shared: dict[Hashable, asyncio.Task[Any]] = {}
        self.fatal: BaseException | None = None
        self._closing = False

    @property
    def background(self) -> int:
        return len(self._tasks)

    def check(self) -> None:
        """Raise the first unexpected error a background task hit, if any."""
        if self.fatal is not None:
            raise TieredKVError(f"a background task failed: {self.fatal!r}") from self.fatal

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str) -> asyncio.Task[T]:
        """Run ``coro`` in the background. Expected failures must be handled inside it;
        anything escaping is a bug, kept as :attr:`fatal` and raised to the owner."""
        if self._closing:
            coro.close()
            raise TieredKVError("the scheduler is closed")
        task: asyncio.Task[T] = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    def start(self, coro: Coroutine[Any, Any, None], *, name: str, done: Callable[[], None]) -> None:
        """Run ``coro``'s first step now, and the rest, if it has to wait, in a background
        task; ``done()`` once it has finished, now or from the task's done callback.

        A job whose copies complete without waiting (nothing to spill, a data plane that
        answers at once) then costs no task and no turn of the loop, and one that waits has
        started its copies before the caller regains the loop. Like a task's, the first
        step runs in a copy of the caller's context; what escapes it is kept as
        :attr:`fatal`, not raised to the caller.
        """
        if self._closing:
            coro.close()
            raise TieredKVError("the scheduler is closed")
        context = contextvars.copy_context()
        try:
            waiting = context.run(coro.send, None)
        except StopIteration:
            done()
            return
        except (KeyboardInterrupt, SystemExit):
            done()
            raise
        except asyncio.CancelledError:
            done()
            return
        except BaseException as exc:
            done()
            self._failed(name, exc)
            return
        task = asyncio.get_running_loop().create_task(_Started(coro, waiting), name=name, context=context)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        task.add_done_callback(lambda _: done())

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):  # the host's, raised out of the loop already
            return
        if exc is not None:
            self._failed(task.get_name(), exc)

    def _failed(self, name: str, exc: BaseException) -> None:
        if self.fatal is None:
            self.fatal = exc
            log.error("task.failed", task=name, error=repr(exc))

    def shared(self, key: Hashable, start: Callable[[], Coroutine[Any, Any, T]], *, name: str) -> asyncio.Task[T]:
        """The in-flight task for ``key``, started with ``start()`` if there is none.

        Callers await it through ``asyncio.shield`` so that one caller's cancellation does
        not cancel the job the others wait for.
        """
        task = self._shared.get(key)
        if task is None or task.done():
            task = self.spawn(start(), name=name)
            self._shared[key] = task
            task.add_done_callback(functools.partial(self._forget, key))
        return task

    def _forget(self, key: Hashable, task: asyncio.Task[Any]) -> None:
        if self._shared.get(key) is task:
            del self._shared[key]

    async def drain(self) -> None:
        """Wait until no background task is left (tasks may spawn others). A caller's
        deadline or cancellation ends the wait, never the tasks: they are the copies of
        every caller."""
        while self._tasks:
            await asyncio.wait(list(self._tasks))

    def cancel(self) -> None:
        """Refuse new tasks and cancel every background task, before any of them runs again."""
        self._closing = True
        for task in self._tasks:
            task.cancel()

    async def close(self) -> None:
        """Cancel every background task and wait for each to finish unwinding; a
        cancellation of the caller meanwhile is raised once they have."""
        self.cancel()
        cancelled = False
        while self._tasks:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            cancelled |= await wait_out(tasks)
            self._tasks.difference_update(tasks)  # done; their done callbacks may not have run yet
        if cancelled:
            raise asyncio.CancelledError


async def wait_out(futures: Iterable[asyncio.Future[Any]]) -> bool:
    """Wait until each of ``futures`` is done, without cancelling them, even when the
    awaiting task is cancelled meanwhile; whether it was, for the caller to raise once its
    own clean-up is done. A host may cancel every task at once (``asyncio.run`` does on
    Ctrl-C): a shutdown it cut short would leave files, locks and threads open."""
    pending = [future for future in futures if not future.done()]
    cancelled = False
    while pending:
        try:
            await asyncio.wait(pending)
        except asyncio.CancelledError:
            cancelled = True
        pending = [future for future in pending if not future.done()]
    return cancelled


class _Started(Coroutine[Any, Any, Any]):
    """A coroutine whose first step has run (:meth:`Scheduler.start`), for a task to go on
    with: the task's first step waits for what that step waits for, and every later one
    is the coroutine's own. A cancellation before the task's first step is what it is to
    a task that had run the coroutine from the start: the future it waits for is
    cancelled, and the coroutine sees the cancellation once that future is done (a
    gather's, once its children have unwound), where it waits; a future already done
    gets the cancellation thrown in at once."""

    def __init__(self, coro: Coroutine[Any, Any, Any], waiting: Any) -> None:
        self._coro = coro
        self._waiting: Any = waiting
        self._first = True
        self.__name__ = getattr(coro, "__name__", type(coro).__name__)
        self.__qualname__ = getattr(coro, "__qualname__", self.__name__)

    def send(self, value: Any) -> Any:
        if self._first:
            self._first = False
            waiting, self._waiting = self._waiting, None
            return waiting
        return self._coro.send(value)

    def throw(self, exc: Any, /, *rest: Any) -> Any:
        if self._first:
            self._first = False
            waiting, self._waiting = self._waiting, None
            if waiting is not None and waiting.cancel():
                return waiting  # the task waits for it, then sends: the coroutine reads the cancellation
        return self._coro.throw(exc, *rest)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, None, Any]:  # pragma: no cover - only tasks step it
        raise TypeError("a started coroutine is stepped by its task only")

    @property
    def cr_frame(self) -> FrameType | None:
        """The coroutine's frame, for :meth:`asyncio.Task.get_stack`."""
        return getattr(self._coro, "cr_frame", None)

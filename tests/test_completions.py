"""Worker threads' completions handed to the event loop (tiers/_completions.py) and the
counters it wakes the loop with (tiered_kv/_counterfd.c)."""

from __future__ import annotations

import asyncio
import contextvars
import errno
import gc
import os
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tiered_kv import _counterfd
from tiered_kv.bench.ticks import KernelTicker
from tiered_kv.tiers._completions import Completions, completions
from tiered_kv.tiers._driver import WorkerPool, in_threads

linux_only = pytest.mark.skipif(not KernelTicker.available(), reason="eventfd and timerfd are Linux's")


@pytest.fixture
def own_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A loop the test runs itself (``run_until_complete``), where an interrupt may end a run."""
    loop = asyncio.new_event_loop()
    try:
        yield loop
    finally:
        loop.close()


def post_from_a_thread(target: Completions | Any, fn: Callable[[Any], object], arg: object) -> None:
    """``target.post(fn, arg)`` from another thread, as a worker posts; returns once posted."""
    poster = threading.Thread(target=target.post, args=(fn, arg))
    poster.start()
    poster.join()


@linux_only
def test_a_counter_reads_what_was_added_and_then_zero() -> None:
    fd = _counterfd.eventfd()
    try:
        assert _counterfd.take(fd) == 0
        for _ in range(3):
            _counterfd.signal(fd)
        assert _counterfd.take(fd) == 3
        assert _counterfd.take(fd) == 0
    finally:
        os.close(fd)


@linux_only
def test_a_counter_of_a_closed_or_wrong_descriptor_is_a_typed_error() -> None:
    fd = _counterfd.eventfd()
    os.close(fd)
    for call in (_counterfd.take, _counterfd.signal):
        with pytest.raises(OSError) as raised:
            call(fd)
        assert raised.value.errno == errno.EBADF
        with pytest.raises(TypeError):
            call("3")  # type: ignore[arg-type]
        with pytest.raises(OverflowError):
            call(1 << 40)
    read, write = os.pipe()
    try:
        os.write(write, b"abc")
        with pytest.raises(OSError, match="read moved 3 bytes of 8"):
            _counterfd.take(read)
    finally:
        os.close(read)
        os.close(write)


@linux_only
async def test_a_workers_completion_does_not_wake_the_loop_through_its_self_pipe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loop reads its self-pipe with ``recv``, which gives up the interpreter lock:
    completions wake it through an eventfd it reads keeping the lock. Before, each call a
    worker thread finished went through ``call_soon_threadsafe``."""
    loop = asyncio.get_running_loop()
    woken: list[str] = []
    wake = loop._write_to_self  # type: ignore[attr-defined]

    def counted_wake() -> None:
        woken.append(threading.current_thread().name)
        wake()

    monkeypatch.setattr(loop, "_write_to_self", counted_wake)
    pool = WorkerPool("test", 2)
    try:
        calls = in_threads(pool, lambda i: i * 2, [(i,) for i in range(8)])
        assert await asyncio.wait_for(calls, 10) == list(range(0, 16, 2))
    finally:
        pool.shutdown()
    assert woken == []


@pytest.mark.parametrize("seed", range(6))
async def test_calls_posted_from_many_threads_at_random_each_run_once_in_order_on_the_loop(seed: int) -> None:
    """Posts race the loop taking them (the flag that spares a second wake-up is cleared
    while other threads post): none may be lost or left waiting for a later post, run
    twice, reordered within a thread, or run off the loop's thread. Each thread posts in
    rounds and waits for its round to have run, as a worker's next call waits for the
    loop, so a call left behind stops its thread."""
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    target = completions(loop)
    threads, rounds = rng.randint(2, 8), rng.randint(20, 120)
    ran: list[tuple[int, int]] = []
    off_loop: list[object] = []
    stuck: list[tuple[int, int]] = []
    loop_thread = threading.current_thread()

    def record(item: tuple[int, int, threading.Event | None]) -> None:
        if threading.current_thread() is not loop_thread:
            off_loop.append(item)
        ran.append(item[:2])
        if item[2] is not None:
            item[2].set()

    def post_all(t: int, plan: list[tuple[int, float]]) -> None:
        i = 0
        for posts, pause in plan:
            round_ran = threading.Event()
            for j in range(posts):
                target.post(record, (t, i, round_ran if j == posts - 1 else None))
                i += 1
                if pause:
                    time.sleep(pause)
            if not round_ran.wait(5):
                stuck.append((t, i))
                return

    plans = [[(rng.randint(1, 4), rng.choice((0.0, 0.0, 1e-6, 1e-4))) for _ in range(rounds)] for _ in range(threads)]
    workers = [threading.Thread(target=post_all, args=(t, plan)) for t, plan in enumerate(plans)]
    for worker in workers:
        worker.start()

    # The loop keeps busy meanwhile, as a server's does, taking the wake-ups between turns.
    async def keep_busy() -> None:
        for pause in iter(lambda: rng.choice((0, 0, 1e-4)), None):
            await asyncio.sleep(pause)

    busy = asyncio.ensure_future(keep_busy())
    try:
        while any(worker.is_alive() for worker in workers):
            await asyncio.to_thread(workers[0].join, 0.05)
    finally:
        busy.cancel()
    await asyncio.sleep(0.01)  # a call run twice would run by now
    assert stuck == []
    assert off_loop == []
    posted = [sum(posts for posts, _ in plan) for plan in plans]
    assert sorted(ran) == [(t, i) for t in range(threads) for i in range(posted[t])]
    for t in range(threads):
        assert [i for u, i in ran if u == t] == list(range(posted[t]))


@linux_only
async def test_a_completion_that_raises_is_reported_and_the_others_still_run() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: reported.append(context))
    target = completions(loop)
    ran: list[int] = []
    finished = asyncio.Event()

    def fail(_: object) -> None:
        raise ValueError("boom")

    def post() -> None:
        target.post(ran.append, 1)
        target.post(fail, None)
        target.post(ran.append, 2)
        target.post(lambda _: finished.set(), None)

    threading.Thread(target=post).start()
    await asyncio.wait_for(finished.wait(), 5)
    assert ran == [1, 2]
    assert [type(context["exception"]) for context in reported] == [ValueError]


@linux_only
def test_calls_left_by_an_interrupted_turn_run_on_the_next(own_loop: asyncio.AbstractEventLoop) -> None:
    """A ``KeyboardInterrupt`` in one completion ends the loop's run; the calls posted
    after it are not lost with the wake-up that was taken."""
    target = completions(own_loop)
    ran: list[int] = []
    after = asyncio.Event()

    def interrupt(_: object) -> None:
        raise KeyboardInterrupt

    def run(i: int) -> None:
        ran.append(i)
        after.set()

    post_from_a_thread(target, interrupt, None)
    post_from_a_thread(target, run, 1)
    waiting = own_loop.create_task(after.wait())
    with pytest.raises(KeyboardInterrupt):
        own_loop.run_until_complete(waiting)
    assert ran == []
    own_loop.run_until_complete(asyncio.wait_for(waiting, 5))
    assert ran == [1]


@linux_only
def test_an_interrupt_between_taking_the_wake_up_and_clearing_the_flag_loses_no_later_call(
    monkeypatch: pytest.MonkeyPatch, own_loop: asyncio.AbstractEventLoop
) -> None:
    """Regression (adversarial review): a ``KeyboardInterrupt`` landing after the loop took
    the counter but before it cleared the flag left the flag set with no wake-up pending,
    and no later post woke the loop again: every later worker call on it hung."""
    target = completions(own_loop)
    ran: list[str] = []
    after = asyncio.Event()
    take = _counterfd.take

    def interrupted_take(fd: int) -> int:
        take(fd)
        raise KeyboardInterrupt

    def run(name: str) -> None:
        ran.append(name)
        if name == "later":
            after.set()

    monkeypatch.setattr(_counterfd, "take", interrupted_take)
    post_from_a_thread(target, run, "first")
    waiting = own_loop.create_task(after.wait())
    with pytest.raises(KeyboardInterrupt):
        own_loop.run_until_complete(waiting)
    monkeypatch.setattr(_counterfd, "take", take)
    post_from_a_thread(target, run, "later")
    own_loop.run_until_complete(asyncio.wait_for(waiting, 5))
    assert ran == ["first", "later"]


@linux_only
@pytest.mark.parametrize(
    "between", ["a post lands before the loop takes the wake-up", "the loop runs as a post signals"]
)
def test_a_post_and_a_turn_interleaved_at_their_critical_points_lose_no_later_call(
    monkeypatch: pytest.MonkeyPatch, own_loop: asyncio.AbstractEventLoop, between: str
) -> None:
    """The two races of the flag, forced on one thread: a post just before the loop takes
    the counter, and the loop's whole turn between a post's signal and its return. Neither
    may leave the flag set with no wake-up pending, after which no post would wake the
    loop. (The second fails if a post signals before it sets the flag.)"""
    target = completions(own_loop)
    assert isinstance(target, Completions)
    ran: list[str] = []
    last = asyncio.Event()

    def run(name: str) -> None:
        ran.append(name)
        if name == "last":
            last.set()

    take, signal = _counterfd.take, _counterfd.signal
    if between.startswith("a post"):

        def take_after_a_post(fd: int) -> int:
            monkeypatch.setattr(_counterfd, "take", take)
            target.post(run, "racing")
            return take(fd)

        monkeypatch.setattr(_counterfd, "take", take_after_a_post)
    else:

        def signal_then_run(fd: int) -> None:
            monkeypatch.setattr(_counterfd, "signal", signal)
            signal(fd)
            target._run()  # the loop's turn, between the post's signal and its return

        monkeypatch.setattr(_counterfd, "signal", signal_then_run)
    post_from_a_thread(target, run, "first")
    own_loop.run_until_complete(asyncio.sleep(0.05))
    post_from_a_thread(target, run, "last")
    own_loop.run_until_complete(asyncio.wait_for(last.wait(), 5))
    assert ran == (["first", "racing", "last"] if between.startswith("a post") else ["first", "last"])


@linux_only
async def test_a_completion_that_posts_again_lets_the_loop_run_before_its_call_does() -> None:
    """Invariant 8 for the completions: a turn runs the calls posted before it, so calls
    that keep posting more (a storm of completions) cannot hold the loop; a callback the
    loop has ready runs between each turn and the next."""
    loop = asyncio.get_running_loop()
    target = completions(loop)
    order: list[str] = []
    done = asyncio.Event()

    def again(left: int) -> None:
        order.append(f"completion {left}")
        if left:
            target.post(again, left - 1)  # from the loop's own thread, during its turn
            loop.call_soon(order.append, f"callback {left}")
        else:
            done.set()

    post_from_a_thread(target, again, 3)
    await asyncio.wait_for(done.wait(), 5)
    assert order == [
        "completion 3",
        "callback 3",
        "completion 2",
        "callback 2",
        "completion 1",
        "callback 1",
        "completion 0",
    ]


async def test_completions_run_in_no_callers_context_and_keep_none_alive() -> None:
    """Regression (review): the eventfd's reader took the context of the first task that
    called a worker, ran every completion in it and kept its values for the loop's life."""
    request: contextvars.ContextVar[object] = contextvars.ContextVar("request")
    seen: list[object] = []

    class Request:
        pass

    async def first_caller() -> weakref.ref[Request]:
        held = Request()
        request.set(held)
        pool = WorkerPool("test", 1)
        try:
            await in_threads(pool, lambda: None, [()])
        finally:
            pool.shutdown()
        return weakref.ref(held)

    gone = await asyncio.ensure_future(first_caller())
    completions(asyncio.get_running_loop()).post(lambda _: seen.append(request.get(None)), None)
    await asyncio.sleep(0.05)
    gc.collect()
    assert seen == [None]
    assert gone() is None


@linux_only
def test_a_loops_completions_and_their_eventfd_go_with_the_loop() -> None:
    loop = asyncio.new_event_loop()
    target = completions(loop)
    assert isinstance(target, Completions)
    fd = target._fd
    os.fstat(fd)
    pool = WorkerPool("test", 1)
    try:
        loop.run_until_complete(in_threads(pool, lambda: None, [()]))
    finally:
        pool.shutdown()
    loop.close()
    # A thread still holding them may post to a closed loop: nothing runs, raises or stays.
    target.post(print, "never")
    assert not target._calls
    gone = weakref.ref(loop)
    del target, loop
    gc.collect()
    assert gone() is None
    with pytest.raises(OSError) as raised:
        os.fstat(fd)
    assert raised.value.errno == errno.EBADF


class _LoopWatchingNoFds(asyncio.SelectorEventLoop):
    def add_reader(self, *args: Any) -> None:
        raise NotImplementedError


@pytest.mark.parametrize("missing", ["eventfd", "add_reader"])
def test_without_an_eventfd_completions_go_through_call_soon_threadsafe(
    monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    def no_eventfd() -> int:
        raise OSError(errno.ENOSYS, "no eventfd")

    if missing == "eventfd":
        monkeypatch.setattr(_counterfd, "eventfd", no_eventfd)
    loop = asyncio.new_event_loop() if missing == "eventfd" else _LoopWatchingNoFds()
    try:
        target = completions(loop)
        assert not isinstance(target, Completions)
        pool = WorkerPool("test", 2)
        try:
            assert loop.run_until_complete(in_threads(pool, lambda i: -i, [(1,), (2,)])) == [-1, -2]
        finally:
            pool.shutdown()
    finally:
        loop.close()
    target.post(print, "never")  # a closed loop: dropped, as before

"""Scheduler building blocks: priority gate, bounded budget, shared jobs, fatal errors."""

from __future__ import annotations

import asyncio
import random

import pytest

from tiered_kv.errors import BusyError, TieredKVError
from tiered_kv.scheduler import LOAD_PRIORITY, STORE_PRIORITY, Budget, PriorityGate, Scheduler


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_waiting_loads_go_before_waiting_stores() -> None:
    gate = PriorityGate(1)
    order: list[str] = []
    release = asyncio.Event()

    async def job(name: str, priority: int) -> None:
        async with gate.hold(priority):
            order.append(name)
            if name == "first":
                await release.wait()

    first = asyncio.ensure_future(job("first", STORE_PRIORITY))
    await settle()
    waiting = [
        asyncio.ensure_future(job("store-1", STORE_PRIORITY)),
        asyncio.ensure_future(job("store-2", STORE_PRIORITY)),
        asyncio.ensure_future(job("load", LOAD_PRIORITY)),
    ]
    await settle()
    release.set()
    await asyncio.gather(first, *waiting)
    assert order == ["first", "load", "store-1", "store-2"]
    assert gate.holders == 0


async def test_a_cancelled_waiter_does_not_leak_its_place() -> None:
    gate = PriorityGate(1)
    release = asyncio.Event()

    async def holder() -> None:
        async with gate.hold(STORE_PRIORITY):
            await release.wait()

    held = asyncio.ensure_future(holder())
    await settle()
    waiter = asyncio.ensure_future(gate.hold(LOAD_PRIORITY).__aenter__())
    await settle()
    waiter.cancel()
    release.set()
    await held
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert gate.holders == 0
    async with gate.hold(LOAD_PRIORITY):
        assert gate.holders == 1


async def test_budget_bounds_producers_and_nowait_raises_busy() -> None:
    budget = Budget(4, "queue")
    budget.take_nowait(3)
    with pytest.raises(BusyError, match="queue: 3/4 in use, 2 more requested"):
        budget.take_nowait(2)
    waiting = asyncio.ensure_future(budget.take(2))
    await settle()
    assert not waiting.done()
    budget.give(1)
    await waiting
    assert budget.used == 4
    with pytest.raises(TieredKVError):
        budget.give(5)


async def test_budget_admits_an_oversized_request_alone() -> None:
    budget = Budget(4, "queue")
    await budget.take(10)
    assert budget.used == 10
    budget.give(10)


async def test_budget_serves_waiters_first_come_first_served() -> None:
    budget = Budget(4, "queue")
    budget.take_nowait(4)
    big = asyncio.ensure_future(budget.take(4))
    await settle()
    with pytest.raises(BusyError):
        budget.take_nowait(1)  # a small request may not overtake a waiting big one
    budget.give(4)
    await big


async def test_cancelled_budget_waiter_leaves_no_trace() -> None:
    budget = Budget(2, "queue")
    budget.take_nowait(2)
    waiting = asyncio.ensure_future(budget.take(1))
    await settle()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    budget.give(2)
    assert budget.used == 0


async def test_shared_job_runs_once_for_every_caller() -> None:
    scheduler = Scheduler()
    runs = 0

    async def job() -> int:
        nonlocal runs
        runs += 1
        await asyncio.sleep(0)
        return 7

    first = scheduler.shared("k", job, name="job")
    second = scheduler.shared("k", job, name="job")
    assert first is second and await first == 7 and runs == 1
    await settle()
    third = scheduler.shared("k", job, name="job")
    assert third is not first and await third == 7


async def test_fatal_background_error_is_kept_and_raised() -> None:
    scheduler = Scheduler()

    async def broken() -> None:
        raise RuntimeError("boom")

    scheduler.spawn(broken(), name="broken")
    await scheduler.drain()
    with pytest.raises(TieredKVError, match="boom"):
        scheduler.check()


async def test_close_cancels_background_tasks() -> None:
    scheduler = Scheduler()
    cancelled = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    scheduler.spawn(forever(), name="forever")
    await settle()
    await scheduler.close()
    assert cancelled.is_set() and scheduler.background == 0
    with pytest.raises(TieredKVError, match="closed"):
        scheduler.spawn(forever(), name="late")


async def test_the_gate_counts_only_live_waiters() -> None:
    gate = PriorityGate(1)
    release, forever = asyncio.Event(), asyncio.Event()

    async def hold(until: asyncio.Event) -> None:
        async with gate.hold(STORE_PRIORITY):
            await until.wait()

    held = asyncio.ensure_future(hold(release))
    await settle()
    waiters = [asyncio.ensure_future(hold(forever)) for _ in range(3)]
    await settle()
    assert gate.waiting == 3
    waiters[0].cancel()
    await settle()
    assert gate.waiting == 2
    release.set()
    await held
    await settle()
    assert (gate.waiting, gate.holders) == (1, 1)
    for waiter in waiters:
        waiter.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    assert (gate.waiting, gate.holders) == (0, 0)


async def test_a_waiter_cancelled_while_the_last_holder_releases_does_not_wedge_the_gate() -> None:
    # Regression (issue 9.1): the cancelled waiter's count stayed raised until its task ran
    # again; a newcomer queued behind it while nobody held the gate, and nobody woke it.
    gate = PriorityGate(1)
    release = asyncio.Event()

    async def holder() -> None:
        async with gate.hold(LOAD_PRIORITY):
            await release.wait()

    held = asyncio.ensure_future(holder())
    await settle()
    cancelled = asyncio.ensure_future(gate.hold(LOAD_PRIORITY).__aenter__())
    await settle()
    cancelled.cancel()  # its task has not run yet: it still counts as waiting
    release.set()
    await held  # the last holder leaves in that gap
    entered = asyncio.Event()

    async def newcomer() -> None:
        async with gate.hold(LOAD_PRIORITY):
            entered.set()

    later = asyncio.ensure_future(newcomer())
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    await asyncio.wait_for(entered.wait(), 1)
    await later
    assert gate.holders == 0 and gate.waiting == 0


async def test_a_budget_waiter_cancelled_before_it_is_granted_neither_crashes_give_nor_leaks() -> None:
    # Regression: give() woke a waiter whose future was already cancelled (InvalidStateError),
    # and the waiter then failed to remove itself (ValueError).
    budget = Budget(2, "test")
    budget.take_nowait(2)
    waiter = asyncio.ensure_future(budget.take(1))
    behind = asyncio.ensure_future(budget.take(1))
    await settle()
    waiter.cancel()  # not yet run: its future is cancelled but still queued
    budget.give(2)  # must skip it and grant the next one
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await asyncio.wait_for(behind, 1)
    assert budget.used == 1


@pytest.mark.parametrize("seed", range(20))
async def test_gate_and_budget_under_random_cancellations_keep_their_counts(seed: int) -> None:
    """Many holders and waiters, cancelled at random points: every task finishes, and
    afterwards nothing is held, waiting or taken."""

    rng = random.Random(seed)
    gate = PriorityGate(2)
    budget = Budget(3, "test")
    tasks: list[asyncio.Task[None]] = []

    async def one() -> None:
        n = rng.randint(1, 3)
        async with gate.hold(rng.choice((LOAD_PRIORITY, STORE_PRIORITY))):
            await budget.take(n)
            try:
                for _ in range(rng.randint(0, 3)):
                    await asyncio.sleep(0)
            finally:
                budget.give(n)

    for _ in range(200):
        tasks.append(asyncio.ensure_future(one()))
        if rng.random() < 0.5:
            await asyncio.sleep(0)
        if rng.random() < 0.4:
            rng.choice(tasks).cancel()
    _, pending = await asyncio.wait(tasks, timeout=5)
    assert not pending, f"{len(pending)} tasks never finished: gate {gate.holders}/{gate.waiting}"
    assert gate.holders == 0 and gate.waiting == 0
    assert budget.used == 0


def test_a_keyboard_interrupt_in_a_background_task_is_the_hosts_not_a_failure_of_the_library() -> None:
    """Ctrl-C lands in whichever task runs: asyncio raises it out of the loop, and it
    must not also be kept as a background failure that a later ``close`` raises."""
    scheduler: Scheduler | None = None

    async def interrupted() -> None:
        raise KeyboardInterrupt

    async def main() -> None:
        nonlocal scheduler
        scheduler = Scheduler()
        scheduler.spawn(interrupted(), name="copy")
        await asyncio.sleep(1)

    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(main())
        loop.run_until_complete(asyncio.sleep(0))  # the task's done callback
    finally:
        loop.close()
    assert scheduler is not None
    assert scheduler.fatal is None
    scheduler.check()

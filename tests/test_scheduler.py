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


# -- Scheduler.start: a job's first step now, the rest in a task -------------------------
async def test_a_job_that_never_waits_runs_inside_start_and_leaves_no_task() -> None:
    scheduler = Scheduler()
    seen: list[str] = []

    async def job() -> None:
        seen.append("ran")

    scheduler.start(job(), name="job", done=lambda: seen.append("done"))
    assert seen == ["ran", "done"]  # before start returned, with no turn of the loop
    assert scheduler.background == 0 and scheduler.fatal is None


async def test_a_job_that_waits_has_run_its_first_step_and_finishes_in_a_task() -> None:
    scheduler = Scheduler()
    seen: list[str] = []
    resume = asyncio.get_running_loop().create_future()

    async def job() -> None:
        seen.append("first")
        seen.append(f"got {await resume}")
        await asyncio.sleep(0)  # a bare yield, after the task took over
        seen.append("last")

    scheduler.start(job(), name="job", done=lambda: seen.append("done"))
    assert seen == ["first"] and scheduler.background == 1
    await settle()
    assert seen == ["first"]
    resume.set_result(7)
    await scheduler.drain()
    await settle()
    assert seen == ["first", "got 7", "last", "done"] and scheduler.background == 0


async def test_a_job_whose_first_step_yields_bare_goes_on_in_its_task() -> None:
    scheduler = Scheduler()
    seen: list[str] = []

    async def job() -> None:
        seen.append("first")
        await asyncio.sleep(0)
        seen.append("second")

    scheduler.start(job(), name="job", done=lambda: seen.append("done"))
    assert seen == ["first"]
    await scheduler.drain()
    await settle()
    assert seen == ["first", "second", "done"]


async def test_a_job_cancelled_before_its_task_ran_unwinds_where_it_waits() -> None:
    """The task that goes on with a started job is cancelled before its first step (a
    host's cancel-all, a close): the job sees the cancellation at the await it stopped
    at, its clean-up runs, and the future it waited for is cancelled, as in a task that
    had run it from the start."""
    scheduler = Scheduler()
    seen: list[str] = []
    waited = asyncio.get_running_loop().create_future()

    async def job() -> None:
        try:
            await waited
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        finally:
            seen.append("clean-up")

    scheduler.start(job(), name="job", done=lambda: seen.append("done"))
    await scheduler.close()
    await settle()
    assert seen == ["cancelled", "clean-up", "done"]
    assert waited.cancelled() and scheduler.fatal is None and scheduler.background == 0


async def test_a_job_cancelled_before_its_task_ran_hears_it_once_what_it_waits_for_has_unwound() -> None:
    """Regression: what the job waits for is cancelled, and the job hears the
    cancellation once that is done, as in a task: a task (or a gather) it waits on may
    take turns to unwind, and the job's clean-up must not run before."""
    scheduler = Scheduler()
    seen: list[str] = []

    async def inner() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await asyncio.sleep(0)
            seen.append("inner unwound")
            raise

    async def job() -> None:
        task = asyncio.ensure_future(inner())
        try:
            await task
        except asyncio.CancelledError:
            seen.append(f"job cancelled, inner done: {task.done()}")
            raise

    scheduler.start(job(), name="job", done=lambda: seen.append("done"))
    await scheduler.close()
    await settle()
    assert seen == ["inner unwound", "job cancelled, inner done: True", "done"]


async def test_what_escapes_a_first_step_is_kept_as_fatal_not_raised_to_the_caller() -> None:
    scheduler = Scheduler()
    seen: list[str] = []

    async def job() -> None:
        raise ValueError("bug")

    scheduler.start(job(), name="job", done=lambda: seen.append("done"))
    assert seen == ["done"] and isinstance(scheduler.fatal, ValueError)
    with pytest.raises(TieredKVError, match="background task failed"):
        scheduler.check()


async def test_what_escapes_a_started_job_later_is_kept_as_fatal() -> None:
    scheduler = Scheduler()

    async def job() -> None:
        await asyncio.sleep(0)
        raise ValueError("bug")

    scheduler.start(job(), name="job", done=lambda: None)
    assert scheduler.fatal is None
    await scheduler.drain()
    await settle()
    assert isinstance(scheduler.fatal, ValueError)


async def test_a_keyboard_interrupt_in_a_first_step_is_raised_to_the_host() -> None:
    scheduler = Scheduler()
    seen: list[str] = []

    async def job() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        scheduler.start(job(), name="job", done=lambda: seen.append("done"))
    assert seen == ["done"] and scheduler.fatal is None


async def test_a_first_step_runs_in_a_copy_of_the_callers_context_which_its_task_keeps() -> None:
    import contextvars

    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="caller's")
    scheduler = Scheduler()
    seen: list[str] = []

    async def job() -> None:
        seen.append(var.get())
        var.set("job's")
        await asyncio.sleep(0)
        seen.append(var.get())

    var.set("bound")
    scheduler.start(job(), name="job", done=lambda: None)
    assert var.get() == "bound"  # the job's own setting stays in the job
    await scheduler.drain()
    assert seen == ["bound", "job's"]


async def test_a_closed_scheduler_starts_nothing_and_closes_the_coroutine() -> None:
    scheduler = Scheduler()
    await scheduler.close()
    ran: list[str] = []

    async def job() -> None:
        ran.append("ran")

    coro = job()
    with pytest.raises(TieredKVError, match="closed"):
        scheduler.start(coro, name="job", done=lambda: ran.append("done"))
    assert ran == [] and coro.cr_frame is None  # closed, never run


async def test_a_started_jobs_task_shows_the_jobs_name_and_stack() -> None:
    scheduler = Scheduler()
    waited = asyncio.get_running_loop().create_future()

    async def copy_chunks() -> None:
        await waited

    scheduler.start(copy_chunks(), name="store-r", done=lambda: None)
    [task] = scheduler._tasks
    assert task.get_name() == "store-r" and "copy_chunks" in repr(task)
    assert [frame.f_code.co_name for frame in task.get_stack()] == ["copy_chunks"]
    waited.set_result(None)
    await scheduler.drain()


@pytest.mark.parametrize("seed", range(200))
async def test_started_jobs_under_random_waits_failures_and_cancellations(seed: int) -> None:
    """Random jobs (waits on futures resolved later or never, bare yields, failures) and
    random cancel-alls: each job's ``done`` runs once, after its clean-up; what it awaited
    when cancelled is cancelled; no task is left; a failure is kept iff a job raised.
    Without a cancellation, each job observes what the same job does in a plain task."""
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    programs = [
        [rng.choice(["wait", "wait", "never", "task", "yield", "raise"]) for _ in range(rng.randint(0, 4))]
        for _ in range(rng.randint(1, 4))
    ]
    cancel_after = rng.choice([None, 0, 1, 2, 5])

    async def run(start: bool) -> tuple[list[list[str]], list[int], list[asyncio.Future[int]], Scheduler]:
        scheduler = Scheduler()
        traces: list[list[str]] = [[] for _ in programs]
        dones = [0] * len(programs)
        awaited: list[asyncio.Future[int]] = []

        async def job(j: int, program: list[str]) -> None:
            trace = traces[j]
            children: list[asyncio.Task[int]] = []
            try:
                for i, op in enumerate(program):
                    if op in ("wait", "never"):
                        future = loop.create_future()
                        awaited.append(future)
                        if op == "wait":
                            loop.call_later(0.001 * rng.random(), lambda f=future, v=i: f.done() or f.set_result(v))
                        if op == "never" and cancel_after is None:
                            future.set_result(-1)
                        trace.append(f"got {await future}")
                    elif op == "task":  # a task that takes a turn to unwind when cancelled
                        child = asyncio.ensure_future(unwinding(i))
                        children.append(child)
                        trace.append(f"got {await child}")
                    elif op == "yield":
                        await asyncio.sleep(0)
                        trace.append("yielded")
                    else:
                        raise ValueError(f"job {j}")
            except asyncio.CancelledError:
                trace.append("cancelled")
                raise
            finally:
                assert all(child.done() for child in children), "clean-up before what the job awaited unwound"
                trace.append("clean-up")

        async def unwinding(value: int) -> int:
            try:
                await asyncio.sleep(0.001 * rng.random())
            except asyncio.CancelledError:
                await asyncio.sleep(0)
                raise
            return value

        def finished(j: int) -> None:
            assert traces[j][-1] == "clean-up"
            dones[j] += 1

        for j, program in enumerate(programs):
            if start:
                scheduler.start(job(j, program), name=f"job{j}", done=lambda j=j: finished(j))
            else:
                task = scheduler.spawn(job(j, program), name=f"job{j}")
                task.add_done_callback(lambda _, j=j: finished(j))
        if cancel_after is not None:
            for _ in range(cancel_after):
                await asyncio.sleep(0)
            await scheduler.close()
        else:
            await asyncio.wait_for(scheduler.drain(), 5)
        await settle()
        return traces, dones, awaited, scheduler

    traces, dones, awaited, scheduler = await run(start=True)
    assert dones == [1] * len(programs)
    assert scheduler.background == 0
    assert all(future.done() for future in awaited)  # resolved, or cancelled with its waiter
    failed = [j for j, program in enumerate(programs) if "cancelled" not in traces[j] and "raise" in program]
    assert (scheduler.fatal is not None) == bool(failed), (programs, traces)
    if cancel_after is None:
        plain_traces, plain_dones, _, plain = await run(start=False)
        assert traces == plain_traces and dones == plain_dones
        assert repr(scheduler.fatal) == repr(plain.fatal)

"""The bench's loop-stall ticker and its bystander: a ticker in another process that
measures what the machine does to a loop while a section's load runs."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from tiered_kv.bench.ticks import Bystander, BystanderError, KernelTicker, worst


def test_worst_is_the_max_and_the_99th_percentile_in_ms() -> None:
    assert worst([]) == (0.0, 0.0)
    assert worst([0.004]) == pytest.approx((4.0, 4.0))
    lates = [0.0001] * 98 + [0.002, 0.050]
    stall_max, stall_p99 = worst(lates)
    assert stall_max == pytest.approx(50.0)
    assert 2.0 <= stall_p99 < 50.0, "one late tick in a hundred is above the 99th percentile"


async def test_the_bystander_counts_a_pause_of_its_own_process() -> None:
    """A stopped process wakes late: the pause shows in the next ``take``, and the take
    after it starts afresh."""
    async with Bystander().running() as other:
        await other.take()
        os.kill(other.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(0.25)
        finally:
            os.kill(other.pid, signal.SIGCONT)
        paused_max, paused_p99 = await other.take()
        assert paused_max >= 200.0 and paused_p99 <= paused_max
        assert (await other.take())[0] < 200.0, "the pause was counted once"


async def test_the_bystander_ends_with_its_block_when_the_task_is_cancelled() -> None:
    entered = asyncio.Event()
    pids: list[int] = []

    async def measuring() -> None:
        async with Bystander().running() as other:
            pids.append(other.pid)
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.ensure_future(measuring())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(ProcessLookupError):  # ended and reaped
        os.kill(pids[0], 0)


def test_the_bystander_process_refuses_input_it_does_not_know() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tiered_kv.bench.ticks"], input=b"take\nstop\n", capture_output=True, timeout=60
    )
    assert done.returncode != 0 and b"unexpected input" in done.stderr
    assert done.stdout.count(b"\n") == 1, "it answered the take before it"


@pytest.mark.parametrize("settle_s", [0.0, 0.2])
async def test_a_bystander_that_died_is_the_same_error_however_soon_it_is_asked(settle_s: float) -> None:
    """Asked at once (its pipe may still be open) or once it is gone (writing fails)."""
    with pytest.raises(BystanderError, match=r"ended \(exit status -9\)"):
        async with Bystander().running() as other:
            os.kill(other.pid, signal.SIGKILL)
            await asyncio.sleep(settle_s)
            await other.take()


needs_timerfd = pytest.mark.skipif(not KernelTicker.available(), reason="needs a timerfd (Linux)")


@needs_timerfd
async def test_the_kernel_ticker_counts_a_blocked_loop_from_the_earliest_tick_it_missed() -> None:
    """A loop held for 30 ms finds 30 ticks pending at once: the stall is counted from the
    first of them (30 ms), once, not from the last (under a tick)."""
    ticker = KernelTicker()
    with ticker.running():
        await asyncio.sleep(0.01)
        ticker.take()
        time.sleep(0.03)  # noqa: ASYNC251 (the loop held, on purpose)
        await asyncio.sleep(0.005)
        held_max, held_p99 = ticker.take()
        assert held_max >= 25.0 and held_p99 <= held_max
        await asyncio.sleep(0.01)
        assert ticker.take()[0] < 25.0, "the hold was counted once"


@needs_timerfd
async def test_the_kernel_ticker_ticks_and_lets_go_of_its_timer() -> None:
    ticker = KernelTicker()
    with ticker.running():
        await asyncio.sleep(0.05)
        assert ticker._lates, "no tick in 50 ms of 1 ms ticks"
        fd = ticker._fd
    with pytest.raises(OSError):
        os.fstat(fd)
    assert fd not in asyncio.get_running_loop()._selector.get_map(), "the loop still watches it"  # type: ignore[attr-defined]


@needs_timerfd
async def test_the_kernel_ticker_reads_its_timer_without_os_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """``os.read`` gives up the interpreter lock, and the loop then waits for the threads
    of the load it measures to give it back: the ticker's own stall. It reads keeping the
    lock (``tiered_kv._counterfd.take``)."""

    def gives_up_the_lock(fd: int, n: int) -> bytes:
        raise AssertionError("os.read on the loop")

    monkeypatch.setattr(os, "read", gives_up_the_lock)
    reported: list[object] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: reported.append(context))
    ticker = KernelTicker()
    with ticker.running():
        await asyncio.sleep(0.05)
        assert ticker._lates, "no tick in 50 ms of 1 ms ticks"
    assert reported == []


@needs_timerfd
def test_the_kernel_ticker_outside_a_loop_refuses_before_it_makes_a_timer() -> None:
    """Regression (review): the timerfd was made before the running loop was asked for,
    and a call without one leaked it."""
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        with pytest.raises(RuntimeError), KernelTicker().running():
            pass
    assert len(os.listdir("/proc/self/fd")) == before

"""The nvme journal's group commit (``tiers/nvme_commit.py``) when the host cancels its
committing task: what was added is still committed by the next ``sync``."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from tiered_kv.errors import TierIOError
from tiered_kv.tiers._driver import WorkerPool
from tiered_kv.tiers.nvme_commit import GroupCommit

WINDOW_S = 0.01


class Journal:
    """A commit function that records what it was given; ``gate`` holds a commit in its thread."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail: Exception | None = None

    def commit(self, records: bytes) -> None:
        self.entered.set()
        self.gate.wait()
        if self.fail is not None:
            raise self.fail
        self.frames.append(records)

    def committed(self) -> bytes:
        return b"".join(self.frames)


@pytest.fixture
def pool() -> Any:
    pool = WorkerPool("test", 1)
    yield pool
    pool.shutdown()


async def test_a_sync_after_the_host_cancelled_the_idle_committer_commits_everything(pool: Any) -> None:
    journal = Journal()
    commits = GroupCommit(journal.commit, pool, WINDOW_S, name="test")
    commits.add(b"a", 1)
    commits._task.cancel()  # what asyncio.run does to every task on Ctrl-C
    await asyncio.sleep(0)
    commits.add(b"b", 1)
    await commits.sync()  # before: TierIOError("the journal's committer has stopped")
    assert journal.committed() == b"ab" and commits.pending == 0
    await commits.close()


async def test_a_commit_in_flight_when_the_host_cancels_is_committed_again_and_its_sync_returns(
    pool: Any,
) -> None:
    journal = Journal()
    commits = GroupCommit(journal.commit, pool, WINDOW_S, name="test")
    journal.gate.clear()
    commits.add(b"a", 1)
    waiting = asyncio.ensure_future(commits.sync())
    await asyncio.to_thread(journal.entered.wait)
    commits.add(b"b", 1)
    commits._task.cancel()  # the commit of b"a" is running in its thread
    await asyncio.sleep(0.01)
    journal.gate.set()
    await waiting
    await commits.sync()
    # The cancelled commit's records are committed again ahead of what came after, so
    # that a slot's last record is still its newest.
    assert journal.committed() in (b"ab", b"aab") and journal.frames[-1].endswith(b"b")
    assert commits.pending == 0
    await commits.close()


async def test_a_committer_that_died_of_an_error_is_reported_not_restarted(pool: Any) -> None:
    journal = Journal()
    journal.fail = ValueError("a bug")
    commits = GroupCommit(journal.commit, pool, WINDOW_S, name="test")
    commits.add(b"a", 1)
    with pytest.raises(TierIOError, match="failed: ValueError"):
        await commits.sync()
    with pytest.raises(TierIOError, match="failed: ValueError"):
        await commits.sync()
    assert commits.pending == 1, "the records stay queued"
    with pytest.raises(TierIOError):
        await commits.close()


async def test_a_sync_after_close_is_an_error(pool: Any) -> None:
    journal = Journal()
    commits = GroupCommit(journal.commit, pool, WINDOW_S, name="test")
    commits.add(b"a", 1)
    await commits.close()
    assert journal.committed() == b"a"
    commits.add(b"b", 1)
    with pytest.raises(TierIOError, match="closed"):
        await commits.sync()


async def test_a_sync_begun_while_the_cancelled_commit_was_in_its_thread_still_returns(pool: Any) -> None:
    """The sync waits for the commit after the one in flight; the committer, cancelled
    meanwhile, must wake it (it hung: nothing resolved the next commit's future)."""
    journal = Journal()
    commits = GroupCommit(journal.commit, pool, WINDOW_S, name="test")
    journal.gate.clear()
    commits.add(b"a", 1)
    await asyncio.to_thread(journal.entered.wait)  # the commit of b"a" took its records
    commits.add(b"b", 1)
    waiting = asyncio.ensure_future(commits.sync())
    await asyncio.sleep(0)
    commits._task.cancel()
    await asyncio.sleep(0.01)
    journal.gate.set()
    async with asyncio.timeout(10):
        await waiting
    assert journal.frames[-1].endswith(b"b") and commits.pending == 0
    await commits.close()


async def test_a_sync_returns_when_the_restarted_committer_is_cancelled_before_its_first_step(
    pool: Any,
) -> None:
    """Two cancel-alls in a row: the committer a sync started again is cancelled before
    it ran a line, so it resolves nothing; the sync waited for it forever."""
    journal = Journal()
    commits = GroupCommit(journal.commit, pool, WINDOW_S, name="test")
    await asyncio.sleep(0)
    commits._task.cancel()  # the first sweep
    await asyncio.sleep(0)
    commits.add(b"a", 1)
    waiting = asyncio.ensure_future(commits.sync())
    await asyncio.sleep(0)  # the sync started the committer again and waits for it
    commits._task.cancel()  # the second sweep, before the new committer's first step
    async with asyncio.timeout(10):
        await waiting
    assert journal.committed() == b"a"
    await commits.close()


async def test_close_cancelled_while_it_commits_still_commits_what_was_queued(pool: Any) -> None:
    """A cancel-all cancels the nvme driver's close along with the committer while a
    commit is in flight and more records wait behind it: they were lost (the close
    marked itself closed and stopped the committer); the close raises the cancellation
    once they are committed."""
    journal = Journal()
    commits = GroupCommit(journal.commit, pool, WINDOW_S, name="test")
    journal.gate.clear()
    commits.add(b"a", 1)
    await asyncio.to_thread(journal.entered.wait)  # the commit of b"a" is in its thread
    commits.add(b"b", 1)
    closing = asyncio.ensure_future(commits.close())
    await asyncio.sleep(0)
    closing.cancel()
    commits._task.cancel()
    await asyncio.sleep(0.01)
    journal.gate.set()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(10):
            await closing
    assert journal.frames[-1].endswith(b"b") and commits.pending == 0

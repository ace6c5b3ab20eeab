"""Group commit of the nvme tier's journal records, on the event loop's side.

Writes add their records here as they complete (a cheap append); one task commits what
has gathered once per window — a single call into a driver thread, which syncs the
slots file and the journal (:meth:`tiered_kv.tiers.nvme_journal.Journal.commit`) — so
that the syncs cost once per window, not once per batch, and nothing proportional to a
batch or the tier runs on the loop. :meth:`GroupCommit.sync` closes the window at once.

The crash bound: a record is durable once the commit that took it returns, so a crash
loses at most the records of the window being gathered and of the commit in flight.
A commit that fails keeps its records for the next one (a journal frame that did not
land is overwritten) and is reported to every ``sync`` waiting for it.

The committing task belongs to this object, but the host may cancel it: ``asyncio.run``
cancels every task of the loop at once when Ctrl-C or an error ends its main task, and
a server's shutdown may do the same. A ``sync`` (a drain, a close) that finds it
cancelled starts it again, so that what was acknowledged is still committed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from tiered_kv.errors import TierError, TierIOError
from tiered_kv.log import get_logger
from tiered_kv.tiers._driver import WorkerPool, in_threads

log = get_logger("nvme")


class _Cancelled(TierIOError):
    """What a ``sync`` waiting on a commit hears when the committing task was cancelled."""


def _closed(records: bytes) -> None:
    raise TierIOError("the journal's committer is closed", tier="nvme")


class GroupCommit:
    """Records gathered on the loop and committed by ``commit(records)`` in ``pool``
    once per ``window_s``; construct inside a running loop, :meth:`close` when done."""

    def __init__(self, commit: Callable[[bytes], None], pool: WorkerPool, window_s: float, *, name: str) -> None:
        if not window_s > 0:
            raise ValueError(f"the commit window must be positive, got {window_s}")
        self._commit = commit
        self._pool = pool
        self._window_s = window_s
        self._name = name
        self._pending = bytearray()
        #: Records ever added, and how many of them are durable (both only grow).
        self._added = 0
        self._durable = 0
        self._wake = asyncio.Event()
        self._now = asyncio.Event()
        #: Resolved when the commit in flight (or the next one) ends: None, or its error.
        self._ended: asyncio.Future[TierError | None] = asyncio.get_running_loop().create_future()
        self._closed = False
        self._task = self._start()

    def _start(self) -> asyncio.Task[None]:
        task = asyncio.ensure_future(self._run())
        task.set_name(self._name)
        return task

    @property
    def pending(self) -> int:
        """Records added and not yet durable."""
        return self._added - self._durable

    def add(self, records: bytes, count: int) -> None:
        """Queue ``count`` records (their bytes) for the next commit."""
        self._pending += records
        self._added += count
        self._wake.set()

    async def sync(self) -> None:
        """Return once every record added so far is durable; raise :class:`TierIOError`
        if a commit that should have taken them failed (they stay queued)."""
        target = self._added
        while self._durable < target:
            if self._task.done():
                self._restart()
            ended, task = self._ended, self._task
            self._now.set()
            self._wake.set()
            either: list[asyncio.Future[Any]] = [ended, task]
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if not ended.done():
                continue  # the task ended without a word: cancelled before its first step
            error = ended.result()
            if error is not None and not isinstance(error, _Cancelled):
                raise TierIOError(f"committing the journal: {error.detail}", tier="nvme") from error

    def _restart(self) -> None:
        """Start the committing task again if the host cancelled it; raise if it was closed
        or died of an error of its own."""
        if self._closed:
            raise TierIOError("the journal's committer is closed", tier="nvme")
        if not self._task.cancelled():
            error = self._task.exception()
            raise TierIOError(f"the journal's committer failed: {error!r}", tier="nvme") from error
        log.info("nvme.committer_restarted", committer=self._name, pending=self.pending)
        if self._ended.done():
            self._ended = asyncio.get_running_loop().create_future()
        self._task = self._start()

    async def close(self) -> None:
        """Commit what is queued, then stop; raises what :meth:`sync` raises, stopped anyway.
        A cancellation (a host's cancel-all cancels this close with the committer) is
        raised once the commit has been tried again."""
        cancelled = False
        try:
            try:
                await self.sync()
            except asyncio.CancelledError:
                cancelled = True
                await self.sync()
        finally:
            self._closed = True
            task = self._task
            task.cancel()
            await asyncio.wait([task])  # its own end; a cancellation of this close still raises
            if not task.cancelled() and (error := task.exception()) is not None:
                log.warning("nvme.committer_failed", committer=self._name, error=repr(error))
            # The ended task's traceback holds this object in a cycle, which keeps it until a
            # collection: let go of the driver's commit (its bound method, and with it the
            # driver and its slot map) now.
            self._commit = _closed
        if cancelled:
            raise asyncio.CancelledError

    async def _run(self) -> None:
        try:
            while True:
                await self._commit_next()
        except BaseException as exc:
            if not self._ended.done():  # a sync may be waiting for the next commit
                self._ended.set_result(_stopped(exc))
            raise

    async def _commit_next(self) -> None:
        """Wait for records and for the window (or a sync) to close; commit them."""
        await self._wake.wait()
        if not self._now.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._window_s):
                    await self._now.wait()
        self._wake.clear()
        self._now.clear()
        records, upto = bytes(self._pending), self._added
        ended, self._ended = self._ended, asyncio.get_running_loop().create_future()
        self._pending.clear()
        try:
            if records:
                await in_threads(self._pool, self._commit, [(records,)])
        except TierError as exc:
            self._pending[:0] = records  # retried by the next commit an add or a sync asks for
            log.warning("nvme.commit_failed", committer=self._name, error=str(exc))
            ended.set_result(exc)
        except BaseException as exc:
            self._pending[:0] = records  # committed again, whether or not this commit landed
            ended.set_result(_stopped(exc))
            raise
        else:
            self._durable = upto
            ended.set_result(None)


def _stopped(exc: BaseException) -> TierIOError:
    """What a ``sync`` waiting on a commit hears when the committing task ends with ``exc``."""
    if isinstance(exc, asyncio.CancelledError):
        return _Cancelled("the journal's committer was cancelled", tier="nvme")
    return TierIOError(f"the journal's committer failed: {exc!r}", tier="nvme")

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
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import Executor

from tiered_kv.errors import TierError, TierIOError
from tiered_kv.log import get_logger
from tiered_kv.tiers._driver import in_threads

log = get_logger("nvme")


class GroupCommit:
    """Records gathered on the loop and committed by ``commit(records)`` in ``executor``
    once per ``window_s``; construct inside a running loop, :meth:`close` when done."""

    def __init__(self, commit: Callable[[bytes], None], executor: Executor, window_s: float, *, name: str) -> None:
        if not window_s > 0:
            raise ValueError(f"the commit window must be positive, got {window_s}")
        self._commit = commit
        self._executor = executor
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
        self._task = asyncio.ensure_future(self._run())
        self._task.set_name(name)

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
                raise TierIOError("the journal's committer has stopped", tier="nvme")
            ended = self._ended
            self._now.set()
            self._wake.set()
            error = await asyncio.shield(ended)
            if error is not None:
                raise TierIOError(f"committing the journal: {error.detail}", tier="nvme") from error

    async def close(self) -> None:
        """Commit what is queued, then stop; raises what :meth:`sync` raises, stopped anyway."""
        try:
            await self.sync()
        finally:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
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
                    await in_threads(self._executor, self._commit, [(records,)])
            except TierError as exc:
                self._pending[:0] = records  # retried by the next commit an add or a sync asks for
                log.warning("nvme.commit_failed", committer=self._name, error=str(exc))
                ended.set_result(exc)
            except BaseException:
                self._pending[:0] = records
                ended.set_result(TierIOError("the journal's committer was stopped", tier="nvme"))
                raise
            else:
                self._durable = upto
                ended.set_result(None)

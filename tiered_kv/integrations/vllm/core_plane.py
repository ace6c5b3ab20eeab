"""The engine core's data plane: nvme I/O on the cpu slab's slots, on a thread of its own.

vLLM's scheduler thread runs the control plane, which must never wait. Everything that
touches the disk runs here instead, on the event loop of a :class:`LoopThread` with the
nvme tier drivers (one store per KV group): opening the stores (and their warm restart),
promotions (nvme → cpu slot, verified before the slot may be read), writes (cpu slot →
nvme) and forgetting nvme slots the control plane dropped. Each operation carries a
ticket of the caller's (its plan); results come back in :meth:`CoreDataPlane.results`,
which never blocks.

A promotion has a deadline: one that has not read its chunks by then is cancelled (the
driver lets go of the slot first) and reported failed, so its cpu slot can be reused and
its chunk answers as a miss.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import enum
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

from tiered_kv.config import NvmeTierConfig
from tiered_kv.control import RESTORE_BATCH
from tiered_kv.errors import CorruptChunk, TieredKVError, TierError
from tiered_kv.integrations.vllm.loop_thread import LoopThread
from tiered_kv.interfaces import HostTier, RecoverableTier, TierStats, TransferOp
from tiered_kv.keys import ChunkKey
from tiered_kv.log import get_logger
from tiered_kv.namespace import Namespace
from tiered_kv.registry import TIERS

log = get_logger("vllm.core")

Ticket = TypeVar("Ticket")


class Outcome(enum.Enum):
    OK = "ok"
    #: The I/O failed or ran past its deadline: the bytes are not there.
    FAILED = "failed"
    #: The nvme chunk failed verification: the nvme copy must be dropped.
    CORRUPT = "corrupt"


class NvmeCopy(NamedTuple):
    """One chunk between a cpu slot and an nvme slot."""

    key: ChunkKey
    cpu_slot: int
    nvme_slot: int


class Done(NamedTuple, Generic[Ticket]):
    """A promotion or a write has ended."""

    ticket: Ticket
    outcome: Outcome
    reason: str = ""


class Recovered(NamedTuple):
    """A batch of the chunks a reopened nvme store of KV group ``group`` holds."""

    group: int
    chunks: list[tuple[ChunkKey, int]]
    #: True on the last batch of the group: the store is open.
    last: bool


class CoreDataPlane(Generic[Ticket]):
    """The nvme stores of one engine's KV groups, over the cpu tiers ``cpus[g]``."""

    def __init__(
        self,
        namespace: Namespace,
        cpus: Sequence[HostTier],
        nvme: NvmeTierConfig,
        *,
        nvme_slots: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._namespace = namespace
        self._cpus = list(cpus)
        self._config = nvme
        self._nvme_slots = nvme_slots
        self._clock = clock
        self._stores: list[RecoverableTier] = []
        self._loop = LoopThread("tiered-kv-nvme")
        self._results: collections.deque[Done[Ticket] | Recovered] = collections.deque()
        self._running: set[concurrent.futures.Future[None]] = set()
        self._lock = threading.Lock()
        #: The error that kept the stores from opening, raised to the owner by :meth:`results`.
        self._failure: BaseException | None = None
        self._closed = False

    # -- submitting (any thread; never blocks) ------------------------------------------
    def open(self) -> None:
        """Open (or create) every group's store; :class:`Recovered` batches follow."""
        self._start(self._open())

    def promote(self, ticket: Ticket, group: int, copies: Sequence[NvmeCopy], *, deadline_s: float) -> None:
        """Read nvme chunks into their cpu slots, verified; ``Done(ticket, …)`` follows."""
        self._start(self._promote(ticket, group, list(copies), deadline_s))

    def write(self, ticket: Ticket, group: int, copies: Sequence[NvmeCopy]) -> None:
        """Write cpu slots to nvme slots; ``Done(ticket, …)`` follows."""
        self._start(self._write(ticket, group, list(copies)))

    def forget(self, group: int, slots: Sequence[int]) -> None:
        """Stop vouching for nvme ``slots`` of ``group`` (the control plane dropped them)."""
        self._start(self._forget(group, list(slots)))

    def _start(self, work: Coroutine[Any, Any, None]) -> None:
        if self._closed:
            work.close()
            raise TieredKVError("the engine core's data plane is closed")
        with self._lock:
            future = self._loop.submit(work)
            self._running.add(future)
        future.add_done_callback(self._ended)

    def _ended(self, future: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._running.discard(future)

    # -- results (the control plane's thread; never blocks) --------------------------------
    def has_results(self) -> bool:
        """Whether :meth:`results` has anything to say (cheap: the manager asks at every call)."""
        return bool(self._results) or self._failure is not None

    def results(self) -> list[Done[Ticket] | Recovered]:
        """What has ended since the last call, oldest first. Raises the error that kept
        the nvme stores from opening (a second engine on the same directory, say)."""
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise TieredKVError(f"the nvme tier could not open: {failure}") from failure
        out: list[Done[Ticket] | Recovered] = []
        while self._results:
            out.append(self._results.popleft())
        return out

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait (blocking) until the I/O in flight has ended; for reset and shutdown only."""
        with self._lock:
            running = list(self._running)
        _, not_done = concurrent.futures.wait(running, timeout=timeout_s)
        if not_done:
            raise TieredKVError(f"{len(not_done)} nvme operations still running after {timeout_s} s")

    def statistics(self) -> list[TierStats]:
        """The nvme stores' own counters (ops, bytes, errors)."""
        return [store.statistics() for store in self._stores]

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._running)

    # -- on the loop ----------------------------------------------------------------------
    async def _open(self) -> None:
        opener = TIERS.get("nvme").open  # type: ignore[attr-defined]
        try:
            for group, cpu in enumerate(self._cpus):
                store: RecoverableTier = await opener(
                    self._config.root,
                    self._namespace,
                    slot_bytes=cpu.slot_bytes,
                    num_slots=self._nvme_slots,
                    io_depth=self._config.io_depth,
                    group=group,
                )
                self._stores.append(store)
        except (TierError, OSError, ValueError) as exc:
            log.error("nvme.open_failed", root=self._config.root, error=str(exc))
            self._failure = exc
            return
        for group, store in enumerate(self._stores):
            chunks = list(store.recovered().items())
            starts = range(0, max(len(chunks), 1), RESTORE_BATCH)
            for start in starts:
                self._results.append(Recovered(group, chunks[start : start + RESTORE_BATCH], start == starts[-1]))

    def _ops(self, group: int, copies: list[NvmeCopy]) -> list[TransferOp]:
        cpu = self._cpus[group]
        return [TransferOp(buffer=cpu.view(c.cpu_slot), key=c.key, slot=c.nvme_slot) for c in copies]

    async def _promote(self, ticket: Ticket, group: int, copies: list[NvmeCopy], deadline_s: float) -> None:
        try:
            async with asyncio.timeout(deadline_s):
                await self._stores[group].read(self._ops(group, copies))
        except CorruptChunk as exc:
            self._results.append(Done(ticket, Outcome.CORRUPT, str(exc)))
        except TierError as exc:
            self._results.append(Done(ticket, Outcome.FAILED, str(exc)))
        except TimeoutError:
            self._results.append(Done(ticket, Outcome.FAILED, f"not read within {deadline_s} s"))
        else:
            self._results.append(Done(ticket, Outcome.OK))

    async def _write(self, ticket: Ticket, group: int, copies: list[NvmeCopy]) -> None:
        try:
            await self._stores[group].write(self._ops(group, copies))
        except TierError as exc:
            self._results.append(Done(ticket, Outcome.FAILED, str(exc)))
        else:
            self._results.append(Done(ticket, Outcome.OK))

    async def _forget(self, group: int, slots: list[int]) -> None:
        self._stores[group].forget(slots)

    # -- shutdown -------------------------------------------------------------------------
    def close(self, timeout_s: float | None = None) -> None:
        """Let the I/O in flight finish (up to ``timeout_s``), close the stores (which
        commits their slot maps: the warm restart's record) and the cpu tiers, stop the
        thread."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            running = list(self._running)
        concurrent.futures.wait(running, timeout=timeout_s)

        async def close_stores() -> None:
            for tier in [*self._stores, *self._cpus]:
                await tier.close()

        try:
            self._loop.run(close_stores(), timeout_s)
        finally:
            self._loop.close(timeout_s)

    def __repr__(self) -> str:
        return f"<CoreDataPlane groups={len(self._cpus)} stores={len(self._stores)} in_flight={self.in_flight}>"

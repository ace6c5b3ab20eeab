"""The engine core's side of the vLLM adapter: vLLM's manager calls on the control plane.

vLLM's scheduler asks about one chunk at a time, many times per request (every step a
request waits), and may never wait. :class:`SchedulerSide` answers from the control
plane's residency index, O(1) per key, and hands everything that touches the disk to the
engine core's data-plane thread (:class:`~tiered_kv.integrations.vllm.core_plane.CoreDataPlane`),
whose results it applies, without waiting, at the top of its calls.

- ``lookup``: cpu READY is a hit, leased until the end of the step so that nothing evicts
  it before the same step's ``prepare_load`` pins it; a chunk moving into cpu is a pending
  hit; a chunk only nvme holds is a pending hit and *wanted*: the step's promotions are
  planned at ``schedule_end`` (after every load of the step is pinned) and read on the
  data-plane thread, verified, with a deadline. A promotion that cannot be planned, fails,
  finds corrupt bytes or runs past its deadline makes the chunk a miss for the requests
  that waited for it, so a bad chunk on disk is recomputed, never a failed load (vLLM
  cannot take one).
- ``prepare_store`` stores what fits (the longest prefix per KV group); ``None`` only when
  nothing can be stored now, and vLLM offers the chunks again next step.
- ``reset`` starts a new generation: new, empty pools; the nvme slots forgotten; results
  of the old generation ignored.

Keys are vLLM's ``OffloadKey`` (the engine's hash of a chunk's last block, then the KV
group id as 4 big-endian bytes), bound to the request's namespace into a chunk key once per
request (memoized: vLLM repeats its lookups every step).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import time
from collections.abc import Callable, Iterable, Sequence

import msgspec

from tiered_kv.control import ChunkState, ControlPlane, NvmeWrite, Pool, Promotion, PromotionOutcome, StoreGroup
from tiered_kv.errors import TieredKVError
from tiered_kv.integrations.vllm.core_plane import CoreDataPlane, Done, NvmeCopy, Outcome, Recovered
from tiered_kv.integrations.vllm.stats_file import StatisticsRecord, write_statistics
from tiered_kv.keys import ChunkKey, chunk_keys_from_block_hashes
from tiered_kv.log import get_logger
from tiered_kv.namespace import Namespace
from tiered_kv.stats import KVEventKind, Statistics
from tiered_kv.telemetry import Telemetry

log = get_logger("vllm.manager")

_OUTCOMES = {
    Outcome.OK: PromotionOutcome.DONE,
    Outcome.FAILED: PromotionOutcome.FAILED,
    Outcome.CORRUPT: PromotionOutcome.CORRUPT,
}


class Answer(enum.Enum):
    HIT = "hit"
    HIT_PENDING = "hit_pending"
    MISS = "miss"


class Source(enum.Enum):
    """Where a loaded chunk came from, for vLLM's cached-tokens-by-source counters."""

    HOST = "host"
    DISK = "disk"


class RequestState:
    """One request's namespace and memo, kept in vLLM's per-request context."""

    __slots__ = ("fingerprint", "keys", "namespace", "promoted", "refused")

    def __init__(self, namespace: Namespace) -> None:
        self.namespace = namespace
        self.fingerprint = namespace.fingerprint_hex
        #: OffloadKey → (pool position, chunk key).
        self.keys: dict[bytes, tuple[int, ChunkKey]] = {}
        #: Chunks that could not be promoted for this request: misses from now on.
        self.refused: set[ChunkKey] = set()
        #: Chunks promoted from nvme while this request waited for them.
        self.promoted: set[ChunkKey] = set()


@dataclasses.dataclass(slots=True)
class StoreAnswer:
    """What ``prepare_store`` hands vLLM: the keys to store, their cpu slots per group, and
    the OffloadKeys of the chunks evicted to make room (those it knows)."""

    keys: list[bytes]
    slots: tuple[tuple[int, ...], ...]
    evicted: list[bytes]


@dataclasses.dataclass(slots=True)
class _Wanted:
    """A chunk some lookups of this step want promoted."""

    position: int
    key: ChunkKey
    namespace: str
    #: The requests that wait for it (a set: vLLM looks a waiting request up every step).
    requests: set[RequestState]


@dataclasses.dataclass(slots=True)
class _Promoting:
    plan: Promotion
    deadline: float
    requests: set[RequestState]


@dataclasses.dataclass(slots=True)
class _PendingStore:
    generation: int
    groups: list[StoreGroup]
    chunks: int


@dataclasses.dataclass(slots=True)
class _Event:
    """A run of KV events alike: these keys were stored in, or removed from, one tier."""

    tier: str
    removed: bool
    keys: list[bytes]


PoolOpener = Callable[[], tuple[ControlPlane, list[Pool]]]


class SchedulerSide:
    """vLLM's scheduler-side calls over one engine's control plane and nvme thread.

    ``open_pools`` builds the control plane and its pools (again at every reset);
    ``group_ids[i]`` is the vLLM KV-cache group id of pool position ``i``.
    """

    def __init__(
        self,
        namespace: Namespace,
        open_pools: PoolOpener,
        telemetry: Telemetry,
        *,
        group_ids: Sequence[int],
        core: CoreDataPlane[tuple[int, Promotion | NvmeWrite]] | None,
        nvme_slots: int,
        promotion_deadline_s: float,
        max_store_chunks: int,
        max_nvme_write_chunks: int = 4096,
        track_keys: bool = False,
        reset_fence: bool = False,
        statistics_path: str | None = None,
        statistics_interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.namespace = namespace
        self._open_pools = open_pools
        self.control, self.pools = open_pools()
        self.telemetry = telemetry
        self._positions = {group_id: i for i, group_id in enumerate(group_ids)}
        if len(self._positions) != len(self.pools):
            raise TieredKVError(f"{len(group_ids)} vLLM KV groups for {len(self.pools)} pools")
        self._bpc = self.pools[0].blocks_per_chunk
        self._core = core
        self._nvme_slots = nvme_slots
        self._deadline_s = promotion_deadline_s
        self._max_store_chunks = max_store_chunks
        self._max_nvme_write_chunks = max_nvme_write_chunks
        self._reset_fence = reset_fence
        self._statistics_path = statistics_path
        self._statistics_interval_s = statistics_interval_s
        self._clock = clock
        self._generation = 0
        self._nvme_open = False
        self._recovering = len(self.pools) if core is not None else 0
        for pool in self.pools if core is not None else ():
            self.control.begin_restore(pool)  # the batches arrive from the core's thread
        self._recovered = 0
        self._fenced = False
        self._wanted: dict[tuple[int, ChunkKey], _Wanted] = {}
        self._promoting: dict[tuple[int, ChunkKey], _Promoting] = {}
        #: Stores planned and not yet completed, by OffloadKey.
        self._stores: dict[bytes, _PendingStore] = {}
        self._store_chunks = 0
        self._nvme_write_chunks = 0
        #: Load pins by request: (generation, [(position, key)]).
        self._loads: dict[str, tuple[int, list[tuple[int, ChunkKey]]]] = {}
        #: ChunkKey → OffloadKey of chunks stored, for KV events (only when vLLM wants events).
        self._offload_keys: dict[ChunkKey, bytes] | None = {} if track_keys else None
        self._statistics_due = clock() + statistics_interval_s
        if core is not None:
            core.open()

    # -- requests ------------------------------------------------------------------------
    def new_request(self, tenant: str | None = None) -> RequestState:
        """State for a new request; a tenant gets its own share of the pools (its own
        policy instance and quota) and keys no other tenant can read."""
        if tenant is None:
            return RequestState(self.namespace)
        return RequestState(msgspec.structs.replace(self.namespace, cache_salt=f"tenant:{tenant}"))

    def _chunk(self, request: RequestState, offload_key: bytes) -> tuple[int, ChunkKey]:
        found = request.keys.get(offload_key)
        if found is None:
            group_id = int.from_bytes(offload_key[-4:], "big")
            position = self._positions.get(group_id)
            if position is None:
                raise TieredKVError(f"vLLM KV group {group_id} is not offloaded by this engine")
            block_hash = offload_key[:-4]
            key = chunk_keys_from_block_hashes(request.namespace, (block_hash,) * self._bpc, group=position)[0]
            found = request.keys[offload_key] = (position, key)
        return found

    # -- lookups -------------------------------------------------------------------------
    def lookup(self, request: RequestState, offload_key: bytes) -> Answer:
        self._apply_results()
        position, key = self._chunk(request, offload_key)
        if key in request.refused:
            self.telemetry.missed += 1
            return Answer.MISS
        pool = self.pools[position]
        state = pool.state(key, request.fingerprint)
        if state is ChunkState.CPU_READY:
            self.control.lease(pool, key)
            self.telemetry.hit_cpu += 1
            return Answer.HIT
        if state is ChunkState.CPU_PENDING:
            promoting = self._promoting.get((position, key))
            if promoting is None:  # a store in flight
                self.telemetry.hit_cpu += 1
                return Answer.HIT_PENDING
            if self._clock() > promoting.deadline:
                request.refused.add(key)
                self.telemetry.missed += 1
                return Answer.MISS
            promoting.requests.add(request)
            self.telemetry.hit_nvme += 1
            return Answer.HIT_PENDING
        if state is ChunkState.NVME_READY:
            wanted = self._wanted.get((position, key))
            if wanted is None:
                wanted = self._wanted[(position, key)] = _Wanted(position, key, request.fingerprint, set())
            wanted.requests.add(request)
            self.telemetry.hit_nvme += 1
            return Answer.HIT_PENDING
        self.telemetry.missed += 1
        return Answer.MISS

    def load_source(self, request: RequestState, offload_key: bytes) -> Source:
        _, key = self._chunk(request, offload_key)
        return Source.DISK if key in request.promoted else Source.HOST

    # -- loads ---------------------------------------------------------------------------
    def prepare_load(
        self, request: RequestState, request_id: str, offload_keys: Iterable[bytes]
    ) -> tuple[tuple[int, ...], ...]:
        """Pin every chunk's cpu slot until :meth:`complete_load`; the slots per group.

        Every key was answered ``HIT`` in this step and is leased, so it is READY: a key that
        is not is a bug of the caller, and raises (loading bytes that are not there would
        generate wrong tokens)."""
        self._apply_results()
        if request_id in self._loads:
            raise TieredKVError(f"request {request_id} already has a load in flight")
        slots: list[list[int]] = [[] for _ in self.pools]
        pins: list[tuple[int, ChunkKey]] = []
        try:
            for offload_key in offload_keys:
                position, key = self._chunk(request, offload_key)
                pool = self.pools[position]
                if not pool.cpu.ready_for(key, request.fingerprint):
                    raise TieredKVError(f"prepare_load of chunk {key.hex()}, which is not ready in cpu")
                slots[position].append(self.control.pin(pool, key))
                pins.append((position, key))
        except BaseException:
            for position, key in pins:
                self.control.unpin(self.pools[position], key)
            raise
        for position, key in pins:
            self.telemetry.loaded["nvme" if key in request.promoted else "cpu"] += 1
            if self.control.hit(self.pools[position], key):
                self._copy_to_nvme(position, [key], request.fingerprint)
        self._loads[request_id] = (self._generation, pins)
        return tuple(tuple(group) for group in slots)

    def complete_load(self, request_id: str) -> None:
        generation, pins = self._loads.pop(request_id, (None, []))
        if generation != self._generation:
            return  # planned before a reset: the pools it pinned are gone
        for position, key in pins:
            self.control.unpin(self.pools[position], key)

    # -- stores --------------------------------------------------------------------------
    def prepare_store(self, request: RequestState, offload_keys: Sequence[bytes]) -> StoreAnswer | None:
        """cpu slots for the longest prefix per KV group of the chunks no tier holds;
        ``None`` when nothing can be stored now (vLLM offers them again next step)."""
        self._apply_results()
        if self._fenced:
            return None
        if self._store_chunks and self._store_chunks + len(offload_keys) > self._max_store_chunks:
            return None
        offered: list[dict[ChunkKey, bytes]] = [{} for _ in self.pools]
        for offload_key in offload_keys:
            position, key = self._chunk(request, offload_key)
            offered[position][key] = offload_key
        keys = [list(group) for group in offered]
        # The control plane checks block ids only to skip blocks the engine no longer holds;
        # vLLM hands the blocks to the workers, not to the manager: chunk positions stand in.
        tables = [list(range(len(group) * self._bpc)) for group in keys]
        plan = self.control.plan_store(request.namespace, keys, tables, partial=True)
        if plan.rejected:
            return None
        slots: list[tuple[int, ...]] = [() for _ in self.pools]
        to_store: list[bytes] = []
        pending = _PendingStore(self._generation, list(plan.groups), plan.submitted)
        for group in plan.groups:
            position = self.pools.index(group.pool)
            slots[position] = tuple(group.slots[key] for key, _ in group.chunks)
            for key, _ in group.chunks:
                offload_key = offered[position][key]
                to_store.append(offload_key)
                self._stores[offload_key] = pending
                if self._offload_keys is not None:
                    self._offload_keys[key] = offload_key
        self._store_chunks += plan.submitted
        evicted = []
        if self._offload_keys is not None:
            evicted = [
                self._offload_keys[victim.key]
                for group in plan.groups
                for victim in group.evicted
                if victim.key in self._offload_keys
            ]
        return StoreAnswer(to_store, tuple(slots), evicted)

    def complete_store(self, offload_keys: Iterable[bytes], ok: bool) -> None:
        pendings = {id(p): p for p in (self._stores.pop(k, None) for k in offload_keys) if p is not None}
        for pending in pendings.values():
            if pending.generation != self._generation:
                continue
            self._store_chunks -= pending.chunks
            for group in pending.groups:
                written = self.control.complete_store(group, ok)
                if written:
                    self._copy_to_nvme(self.pools.index(group.pool), written, group.namespace)

    def _copy_to_nvme(self, position: int, keys: list[ChunkKey], namespace: str) -> None:
        if self._core is None or not self._nvme_open:
            return
        if self._nvme_write_chunks and self._nvme_write_chunks + len(keys) > self._max_nvme_write_chunks:
            log.info("store.skipped", tier="nvme", n_chunks=len(keys), reason="queue full")
            return
        write = self.control.plan_nvme_copy(self.pools[position], keys, namespace)
        if write is None:
            return
        self._nvme_write_chunks += len(write.chunks)
        copies = [NvmeCopy(key, cpu_slot, nvme_slot) for key, cpu_slot, nvme_slot in write.chunks]
        self._core.write((self._generation, write), position, copies)

    # -- the step ------------------------------------------------------------------------
    def schedule_end(self) -> None:
        """Plan the promotions this step's lookups want, then end the step's leases."""
        self._apply_results()
        now = self._clock()
        for wanted in self._wanted.values():
            pool = self.pools[wanted.position]
            plan = self.control.plan_promotion(pool, wanted.key, wanted.namespace)
            if plan is True:
                continue
            if plan is False:
                for request in wanted.requests:
                    request.refused.add(wanted.key)
                continue
            assert self._core is not None and isinstance(plan, Promotion)
            self._promoting[(wanted.position, wanted.key)] = _Promoting(plan, now + self._deadline_s, wanted.requests)
            copy = NvmeCopy(wanted.key, plan.cpu_slot, plan.nvme_slot)
            self._core.promote((self._generation, plan), wanted.position, [copy], deadline_s=self._deadline_s)
        self._wanted.clear()
        self.control.end_step()
        if self._statistics_path is not None and now >= self._statistics_due:
            self._statistics_due = now + self._statistics_interval_s
            self.write_statistics(final=False)

    def has_pending_work(self) -> bool:
        """Promotions wanted or running: the engine must keep stepping to see them land."""
        return bool(self._wanted or self._promoting)

    def _apply_results(self) -> None:
        core = self._core
        if core is None or not core.has_results():
            return
        for result in core.results():
            if isinstance(result, Recovered):
                self._restore(result)
                continue
            self._done(result)

    def _restore(self, batch: Recovered) -> None:
        if self._generation == 0:
            pool = self.pools[batch.group]
            if batch.chunks:
                keys, slots = zip(*batch.chunks, strict=True)
                self.control.restore(pool, keys, slots)
            if batch.last:
                self.control.restored(pool)
            self._recovered += len(batch.chunks)
        if batch.last:
            self._recovering -= 1
            if not self._recovering:
                self._nvme_open = True
                log.info("nvme.opened", namespace=self.namespace.fingerprint_hex, recovered=self._recovered)

    def _done(self, done: Done[tuple[int, Promotion | NvmeWrite]]) -> None:
        generation, plan = done.ticket
        if isinstance(plan, NvmeWrite):
            if generation != self._generation:
                return
            self._nvme_write_chunks -= len(plan.chunks)
            forget = self.control.complete_nvme_write(plan, done.outcome is Outcome.OK)
            position = self.pools.index(plan.pool)
        else:
            if generation != self._generation:
                return
            position = self.pools.index(plan.pool)
            promoting = self._promoting.pop((position, plan.key), None)
            waiting = promoting.requests if promoting is not None else set()
            forget = self.control.complete_promotion(plan, _OUTCOMES[done.outcome])
            for request in waiting:
                (request.promoted if done.outcome is Outcome.OK else request.refused).add(plan.key)
            if done.outcome is not Outcome.OK:
                log.warning(
                    "chunk.promotion_failed", key=plan.key.hex(), outcome=done.outcome.value, reason=done.reason
                )
        if forget and self._core is not None:
            self._core.forget(position, forget)

    # -- events --------------------------------------------------------------------------
    def take_events(self) -> list[_Event]:
        """KV events since the last call, as runs of (tier, stored/removed, OffloadKeys)."""
        self._apply_results()
        events = self.telemetry.drain_events()
        if self._offload_keys is None:
            return []
        runs: list[_Event] = []
        for event in events:
            offload_key = self._offload_keys.get(event.key)
            if offload_key is None:
                continue  # restored by a warm restart: its OffloadKey was never seen
            removed = event.kind is KVEventKind.REMOVED
            if removed and not self.pools[event.group].resident_anywhere(event.key):
                del self._offload_keys[event.key]
            if runs and (runs[-1].tier, runs[-1].removed) == (event.tier, removed):
                runs[-1].keys.append(offload_key)
            else:
                runs.append(_Event(event.tier, removed, [offload_key]))
        return runs

    # -- reset and shutdown ----------------------------------------------------------------
    def reset(self, timeout_s: float = 60.0) -> None:
        """Drop every chunk: new, empty pools; the nvme stores emptied. I/O of the engine
        core in flight is waited for first (bounded by the promotion deadline and one
        write), so that no old read or write touches a slot the new pools hand out; vLLM
        flushes the workers' jobs itself before it submits new ones."""
        if self._core is not None:
            self._core.drain(timeout_s)
            self._apply_results()
        self._generation += 1
        self.control, self.pools = self._open_pools()
        self._wanted.clear()
        self._promoting.clear()
        self._stores.clear()
        self._loads.clear()
        self._store_chunks = self._nvme_write_chunks = 0
        if self._offload_keys is not None:
            self._offload_keys.clear()
        if self._core is not None:
            for position in range(len(self.pools)):
                self._core.forget(position, range(self._nvme_slots))
        self._fenced = self._reset_fence
        log.info("cache.reset", namespace=self.namespace.fingerprint_hex, generation=self._generation)

    def reset_flushed(self) -> None:
        """Every job in flight at the reset has been reported: stores may begin again."""
        self._fenced = False

    def statistics(self) -> Statistics:
        tiers, namespaces = self.control.usage()
        return self.telemetry.statistics(
            tiers=tiers,
            namespaces=namespaces,
            queue_depths={
                "stores": self._store_chunks,
                "nvme_writes": self._nvme_write_chunks,
                "promotions": len(self._promoting),
                "loads": len(self._loads),
                "nvme_io": self._core.in_flight if self._core is not None else 0,
            },
            drivers=self._core.statistics() if self._core is not None else [],
        )

    def write_statistics(self, *, final: bool) -> None:
        """Rewrite the statistics file (a small JSON file, replaced atomically)."""
        if self._statistics_path is None:
            return
        record = StatisticsRecord(
            model_id=self.namespace.model_id,
            namespace=self.namespace.fingerprint_hex,
            pid=os.getpid(),
            written_at=time.time(),
            final=final,
            nvme_open=self._nvme_open,
            recovered_chunks=self._recovered,
            statistics=self.statistics(),
        )
        try:
            write_statistics(self._statistics_path, record)
        except OSError as exc:
            log.warning("statistics.unwritable", path=self._statistics_path, error=str(exc))

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Finish the engine core's I/O (the nvme slot maps are committed), write the final
        statistics, stop the nvme thread."""
        if self._core is not None:
            self._core.drain(timeout_s)
            self._apply_results()
        self.write_statistics(final=True)
        if self._core is not None:
            self._core.close(timeout_s)

    def __repr__(self) -> str:
        tiers, _ = self.control.usage()
        usage = " ".join(f"{t.tier}={t.used_chunks}/{t.capacity_chunks}" for t in tiers)
        return f"<SchedulerSide {usage} promoting={len(self._promoting)} stores={self._store_chunks}>"

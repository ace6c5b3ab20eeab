"""``TieredKV``: the API an async inference server embeds.

The engine registers each namespace with its GPU KV tensors (one registration per
tensor-parallel rank), then per request:

* ``lookup`` (sync) — how many leading chunks some tier holds ready;
* ``await load`` — bring those chunks into the GPU blocks the engine allocated;
* ``await store`` — submit copies of full chunks out of GPU blocks (waiting only for
  queue room, never for the copies);
* ``await finish_request`` — returns once no store of the request still reads its GPU
  blocks, so the engine may free them (deferred finalization); ``flush`` does the same
  for given blocks before the engine overwrites them (preemption).

Each model runner's KV group (its base namespace, without the tenant fields, × group) is
a *pool*: a cpu slab and an nvme store of equal-sized chunk slots with one residency
index each, shared by the runner's tenants (LoRA adapters, cache salts) through a
partition with a policy and a quota per tenant. Replicated layouts (MLA) have one
fingerprint for all ranks, so all ranks share one copy of every chunk.

Every decision (which slots, which victims) is made synchronously on the residency
indexes; only copies are awaited, and every exit path — failure or cancellation — rolls
the indexes back before re-raising, so they are consistent at every ``await``.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import msgspec
import torch
from structlog.contextvars import bound_contextvars

from tiered_kv.arguments import (
    blocks_in_range,
    per_group,
    require_block_ids,
    require_keys,
    require_namespace,
    require_request_id,
)
from tiered_kv.checks import is_int_at_least
from tiered_kv.config import NamespacePolicyConfig, NvmeTierConfig, TieredKVConfig, WritePolicy
from tiered_kv.directory import Reservation, TierIndex, Victim
from tiered_kv.errors import (
    BlockTableError,
    ChunkKeyError,
    ConfigError,
    CorruptChunk,
    NamespaceError,
    SpanError,
    TieredKVError,
    TierError,
)
from tiered_kv.interfaces import AdmissionFilter, TierDriver, TransferOp
from tiered_kv.keys import ChunkKey
from tiered_kv.layout import AttentionKind
from tiered_kv.log import get_logger
from tiered_kv.namespace import Namespace
from tiered_kv.partition import TierPartition
from tiered_kv.policy_factory import make_admission_filter
from tiered_kv.registry import TIERS
from tiered_kv.scheduler import LOAD_PRIORITY, STORE_PRIORITY, Budget, PriorityGate, Scheduler
from tiered_kv.spans import cdiv, span_chunks, validate_window_span, window_span
from tiered_kv.stats import (
    LOAD_LATENCY_BOUNDS_MS,
    KVEvent,
    KVEventKind,
    LatencyHistogram,
    NamespaceUsage,
    Statistics,
    TierUsage,
)

log = get_logger("manager")


class HostTier(TierDriver, Protocol):
    """A tier whose slots are host memory the other drivers copy into and out of."""

    def view(self, slot: int) -> torch.Tensor: ...


class RecoverableTier(TierDriver, Protocol):
    """A persistent tier that knows, after reopening, which chunk each slot holds."""

    def recovered(self) -> dict[ChunkKey, int]: ...

    def forget(self, slots: Iterable[int]) -> None:
        """Stop vouching for what ``slots`` hold (the core dropped those chunks)."""
        ...


class TierFactory(Protocol):
    """Builds the drivers of one pool; injected so tests and benches can swap media."""

    def gpu(self, namespace: Namespace, group: int, tensors: Sequence[torch.Tensor]) -> TierDriver: ...

    def cpu(self, namespace: Namespace, group: int, slot_bytes: int, num_slots: int) -> HostTier: ...

    async def nvme(
        self, namespace: Namespace, group: int, slot_bytes: int, num_slots: int, config: NvmeTierConfig
    ) -> RecoverableTier: ...


class StoreResult(msgspec.Struct, frozen=True, kw_only=True):
    #: Chunks whose copies were submitted.
    submitted: int
    #: Chunks skipped because some tier already holds (or is writing) them.
    skipped: int
    #: True when nothing could be evicted to make room: nothing was submitted or changed.
    rejected: bool = False


class _Pool:
    """One model runner's KV group (a base namespace × group): a cpu slab, maybe an nvme
    store, their indexes, shared by the runner's tenants (LoRA adapters, cache salts)."""

    def __init__(
        self,
        namespace: Namespace,
        group: int,
        policy: NamespacePolicyConfig,
        cpu: HostTier,
        cpu_index: TierIndex,
        nvme: RecoverableTier | None,
        nvme_index: TierIndex | None,
    ) -> None:
        self.fingerprint = namespace.fingerprint_hex
        self.model_id = namespace.model_id
        self.group = group
        geometry = namespace.geometry
        self.kind = geometry.groups[group].kind
        self.window = geometry.groups[group].window
        self.block_size = geometry.block_size
        self.chunk_size = geometry.chunk_size
        self.blocks_per_chunk = geometry.blocks_per_chunk
        self.chunk_bytes = geometry.chunk_bytes(group)
        self.policy = policy
        self.cpu = cpu
        self.cpu_index = cpu_index
        self.nvme = nvme
        self.nvme_index = nvme_index
        self.gpus: dict[int, TierDriver] = {}
        #: Turns away chunks not yet seen often enough to be worth storing (``None``: none).
        self.admission: AdmissionFilter | None = None
        #: Tenant namespaces (fingerprints) that have a share in this pool's partitions.
        self.owners: set[str] = set()

    def ready_anywhere(self, key: ChunkKey, owner: str) -> bool:
        """Whether some tier holds ``key`` ready for namespace ``owner`` (its fingerprint)."""
        return self.cpu_index.ready_for(key, owner) or (
            self.nvme_index is not None and self.nvme_index.ready_for(key, owner)
        )

    def resident_anywhere(self, key: ChunkKey) -> bool:
        return key in self.cpu_index or (self.nvme_index is not None and key in self.nvme_index)


class _StoreJob:
    """Chunks of one store call being copied out of one rank's GPU blocks."""

    def __init__(
        self,
        pool: _Pool,
        namespace: str,
        rank: int,
        request_id: str,
        chunks: list[tuple[ChunkKey, tuple[int, ...]]],
    ) -> None:
        self.pool = pool
        #: The fingerprint of the namespace storing (a model's, or one of its tenants').
        self.namespace = namespace
        self.rank = rank
        self.request_id = request_id
        self.chunks = chunks
        self.blocks = frozenset(block for _, blocks in chunks for block in blocks)
        self.started = False
        #: Resolved once no copy of this job reads GPU blocks any more (done, failed or cancelled).
        self.gpu_released: asyncio.Future[None] = asyncio.get_running_loop().create_future()


@dataclasses.dataclass(frozen=True, slots=True)
class _LoadPlan:
    """One group's part of a load: chunk keys in order and where each lands on the GPU."""

    pool: _Pool
    #: The fingerprint of the namespace loading: only its own chunks are staged.
    namespace: str
    keys: list[ChunkKey]
    blocks: list[tuple[int, ...]]
    first_blocks: list[int]


class TieredKV:
    """Tiered KV-cache offloading for one engine process; use as ``async with``."""

    def __init__(
        self,
        config: TieredKVConfig,
        *,
        tiers: TierFactory | None = None,
        max_store_chunks: int = 4096,
        max_write_behind_chunks: int = 4096,
        copy_concurrency: int = 2,
        max_events: int = 65536,
        max_tenants: int = 1024,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not isinstance(config, TieredKVConfig):
            raise ConfigError(f"must be a TieredKVConfig, got {type(config).__name__}", field="config")
        for name, value in (
            ("max_store_chunks", max_store_chunks),
            ("max_write_behind_chunks", max_write_behind_chunks),
            ("copy_concurrency", copy_concurrency),
            ("max_events", max_events),
            ("max_tenants", max_tenants),
        ):
            if not is_int_at_least(value, 1):
                raise ConfigError(f"must be a positive integer, got {value!r}", field=name)
        self.config = config
        self._tiers: TierFactory = tiers if tiers is not None else RegistryTiers()
        self._clock = clock
        self._pools: dict[tuple[str, int], _Pool] = {}
        self._registering = asyncio.Lock()
        #: Loads waiting on each shared nvme → cpu promotion, by (pool, group, key).
        self._promotion_claims: collections.Counter[tuple[str, int, ChunkKey]] = collections.Counter()
        self._max_tenants = max_tenants
        self._cpu_left = config.cpu.capacity_bytes
        self._nvme_left = config.nvme.capacity_bytes if config.nvme else 0
        self._scheduler = Scheduler()
        #: GPU copy jobs at once, and nvme I/O calls at once; loads go first at both.
        self._gate = PriorityGate(copy_concurrency)
        self._disk_gate = PriorityGate(config.nvme.io_depth if config.nvme else 1)
        self._store_budget = Budget(max_store_chunks, "store queue (chunks)")
        self._write_behind_budget = Budget(max_write_behind_chunks, "nvme write-behind queue (chunks)")
        #: Store jobs still reading GPU blocks, by request.
        self._jobs: dict[str, set[_StoreJob]] = collections.defaultdict(set)
        self._events: collections.deque[KVEvent] = collections.deque(maxlen=max_events)
        self._events_dropped = 0
        self._lookups: collections.Counter[str] = collections.Counter()
        self._loaded: collections.Counter[str] = collections.Counter()
        self._load_latency = [0] * (len(LOAD_LATENCY_BOUNDS_MS) + 1)
        self._load_ms = 0.0
        self._bytes: collections.Counter[str] = collections.Counter()
        self._rejected: collections.Counter[str] = collections.Counter()
        self._stores_rejected = 0
        self._loads_in_flight = 0
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------
    async def __aenter__(self) -> TieredKV:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        await self.close(drain=exc_type is None)

    async def close(self, *, drain: bool = True) -> None:
        """Finish (or, with ``drain=False``, cancel) background copies, then close every
        driver. Raises the first fatal background error, if one happened."""
        if self._closed:
            return
        try:
            if drain and self._scheduler.fatal is None:
                await self._scheduler.drain()  # write-behind may still start copies here
        finally:
            self._closed = True
            self._scheduler.cancel()  # no background copy gets another step
            # Shielded: a caller's deadline must not leave drivers (files, threads) open.
            await asyncio.shield(self._shut_down())
        self._scheduler.check()

    async def _shut_down(self) -> None:
        """Stop background copies, then close every driver, even after one fails to close;
        the first failure is raised once all are closed."""
        await self._scheduler.close()
        failures: list[BaseException] = []
        for driver in self._drivers():
            try:
                await driver.close()
            except Exception as exc:
                log.error("driver.close_failed", tier=driver.name, error=repr(exc))
                failures.append(exc)
        if failures:
            raise failures[0]

    def _check(self) -> None:
        if self._closed:
            raise TieredKVError("TieredKV is closed")
        self._scheduler.check()

    def __repr__(self) -> str:
        cpu = sum(p.cpu_index.used for p in self._pools.values())
        cpu_cap = sum(p.cpu_index.num_slots for p in self._pools.values())
        nvme = sum(p.nvme_index.used for p in self._pools.values() if p.nvme_index is not None)
        nvme_cap = sum(p.nvme_index.num_slots for p in self._pools.values() if p.nvme_index is not None)
        inflight = sum(map(len, self._jobs.values())) + self._loads_in_flight
        return f"<TieredKV cpu={cpu}/{cpu_cap} nvme={nvme}/{nvme_cap} inflight={inflight}>"

    # -- registration ------------------------------------------------------------------
    async def register(self, namespace: Namespace, kv_caches: Sequence[Sequence[torch.Tensor]]) -> None:
        """Attach one rank's GPU KV tensors, one list per KV group (each ``[num_blocks, …]``).

        The first registration of a namespace fingerprint creates its pools, taking
        ``cpu_bytes``/``nvme_bytes`` of its namespace config (default: all capacity left);
        a replicated namespace's other ranks join the same pools.
        """
        self._check()
        geometry = namespace.geometry
        if len(kv_caches) != len(geometry.groups):
            raise ConfigError(f"{len(kv_caches)} tensor lists for {len(geometry.groups)} KV groups", field="kv_caches")
        base = namespace.base
        async with self._registering:  # replicated ranks registering at once open one set of pools
            if (base.fingerprint_hex, 0) not in self._pools:
                await self._open_pools(base)
        pools = [self._pools[(base.fingerprint_hex, group)] for group in range(len(kv_caches))]
        if any(namespace.tp_rank in pool.gpus for pool in pools):
            raise ConfigError(f"rank {namespace.tp_rank} of {namespace.model_id} is already registered")
        gpus: list[TierDriver] = []
        try:
            for group, tensors in enumerate(kv_caches):
                try:
                    gpus.append(self._tiers.gpu(base, group, tensors))
                except ValueError as exc:
                    raise ConfigError(f"group {group}: {exc}", field="kv_caches") from exc
                if gpus[-1].slot_bytes != geometry.block_bytes(group):
                    raise ConfigError(
                        f"group {group}: the tensors hold {gpus[-1].slot_bytes} bytes per block, the namespace's "
                        f"geometry {geometry.block_bytes(group)}",
                        field="kv_caches",
                    )
        except BaseException:
            for gpu in gpus:
                await gpu.close()
            raise
        for pool, gpu in zip(pools, gpus, strict=True):
            pool.gpus[namespace.tp_rank] = gpu
        log.info(
            "namespace.registered", namespace=base.fingerprint_hex, model=namespace.model_id, rank=namespace.tp_rank
        )

    async def _open_pools(self, base: Namespace) -> None:
        policy = self.config.policy_for(base.model_id)
        geometry = base.geometry
        all_groups_bytes = sum(geometry.chunk_bytes(g) for g in range(len(geometry.groups)))
        cpu_budget = self._take_budget("cpu", policy.cpu_bytes, self._cpu_left)
        nvme_budget = 0
        if self.config.nvme is not None:
            nvme_budget = self._take_budget("nvme", policy.nvme_bytes, self._nvme_left)
        # Every group holds the same number of chunks: a token chunk is cached in all of them.
        cpu_slots = cpu_budget // all_groups_bytes
        nvme_slots = nvme_budget // all_groups_bytes
        if cpu_slots == 0:
            raise ConfigError(
                f"cpu budget {cpu_budget} B cannot hold one chunk of {base.model_id} ({all_groups_bytes} B)",
                field="cpu_bytes",
            )
        pools: list[_Pool] = []
        try:
            for group in range(len(geometry.groups)):
                pools.append(await self._open_pool(base, group, policy, cpu_slots, nvme_slots))
        except BaseException:
            for pool in pools:
                await pool.cpu.close()
                if pool.nvme is not None:
                    await pool.nvme.close()
            raise
        # Committed only once every group's drivers are open: a failed registration leaves nothing.
        self._cpu_left -= cpu_budget
        self._nvme_left -= nvme_budget
        for pool in pools:
            self._pools[(base.fingerprint_hex, pool.group)] = pool
            log.info(
                "pool.opened",
                namespace=pool.fingerprint,
                group=pool.group,
                cpu_chunks=cpu_slots,
                nvme_chunks=nvme_slots,
                recovered=len(pool.nvme_index) if pool.nvme_index is not None else 0,
            )

    async def _open_pool(
        self, base: Namespace, group: int, policy: NamespacePolicyConfig, cpu_slots: int, nvme_slots: int
    ) -> _Pool:
        chunk_bytes = base.geometry.chunk_bytes(group)
        cpu = self._tiers.cpu(base, group, chunk_bytes, cpu_slots)
        nvme = nvme_index = None
        try:
            if self.config.nvme is not None and nvme_slots:
                nvme = await self._tiers.nvme(base, group, chunk_bytes, nvme_slots, self.config.nvme)
                nvme_index = TierIndex("nvme", TierPartition("nvme", nvme_slots, clock=self._clock))
            cpu_index = TierIndex("cpu", TierPartition("cpu", cpu_slots, clock=self._clock))
            pool = _Pool(base, group, policy, cpu, cpu_index, nvme, nvme_index)
            if policy.admission is not None:
                # It remembers a few times more chunks than the tiers hold: a chunk worth
                # storing comes back before that many others have been seen.
                remembered = 4 * (cpu_slots + nvme_slots)
                pool.admission = make_admission_filter(policy.admission, remembered, k=policy.admission_k)
            owner = self._owner(pool, base)
            if nvme is not None and nvme_index is not None:
                # A warm restart cannot tell which tenant stored a chunk: it counts in the base share.
                for key, slot in nvme.recovered().items():
                    nvme_index.restore(key, slot, owner)
        except BaseException:
            await cpu.close()
            if nvme is not None:
                await nvme.close()
            raise
        return pool

    def _owner(self, pool: _Pool, namespace: Namespace) -> str:
        """``namespace``'s share in the pool's partitions, added on its first use with the
        policy and quotas of its model's config. A quota that no longer fits beside the
        others' is dropped (logged as ``quota.unavailable``): the tenant shares the rest.

        Shares are bounded (``max_tenants`` per pool): past the bound, tenants holding no
        chunk lose their share, and if none does, the newcomer's chunks count in the
        model's own share (logged as ``tenant.limit``); keys keep tenants apart either way.
        """
        owner = namespace.fingerprint_hex
        if owner in pool.owners:
            return owner
        indexes = [index for index in (pool.cpu_index, pool.nvme_index) if index is not None]
        if len(pool.owners) >= self._max_tenants:
            idle = [
                other
                for other in pool.owners
                if other != pool.fingerprint and not any(index.partition.usage(other) for index in indexes)
            ]
            for other in idle:
                for index in indexes:
                    index.partition.remove_namespace(other)
                pool.owners.discard(other)
            if not idle:
                log.warning("tenant.limit", namespace=owner, pool=pool.fingerprint, max_tenants=self._max_tenants)
                return pool.fingerprint
        for index in indexes:
            quota = pool.policy.quota_chunks.get(index.tier, 0)
            try:
                index.partition.add_namespace(owner, pool.policy.policy, quota=quota)
            except ConfigError as exc:
                log.warning("quota.unavailable", namespace=owner, tier=index.tier, quota=quota, error=str(exc))
                index.partition.add_namespace(owner, pool.policy.policy)
        pool.owners.add(owner)
        return owner

    def _take_budget(self, tier: str, wanted: int | None, left: int) -> int:
        if wanted is None:
            return left
        if wanted > left:
            raise ConfigError(f"{wanted} B of {tier} requested but only {left} B are unassigned", field=f"{tier}_bytes")
        return wanted

    def _pools_of(self, namespace: Namespace) -> list[_Pool]:
        fingerprint = require_namespace(namespace).base.fingerprint_hex
        pools = []
        for group in range(len(namespace.geometry.groups)):
            pool = self._pools.get((fingerprint, group))
            if pool is None or namespace.tp_rank not in pool.gpus:
                raise NamespaceError(f"namespace {namespace.model_id} rank {namespace.tp_rank} is not registered")
            pools.append(pool)
        return pools

    # -- lookup ------------------------------------------------------------------------
    def lookup(self, namespace: Namespace, keys: Sequence[Sequence[ChunkKey]]) -> int:
        """How many leading chunks can be loaded now: every full-attention (and MLA) group
        holds chunks ``0 … n−1`` ready and every sliding-window group holds the chunks its
        window at ``n`` chunks overlaps. A chunk whose store is in flight is not a hit."""
        self._check()
        pools = self._pools_of(namespace)
        per_group(keys, len(pools), "keys", ChunkKeyError)
        owner = namespace.fingerprint_hex
        asked = n = min(len(group_keys) for group_keys in keys)
        windowed = []
        #: Positions some full-attention group holds only in nvme.
        from_nvme: set[int] = set()
        try:
            for pool, group_keys in zip(pools, keys, strict=True):
                if pool.kind is AttentionKind.SLIDING_WINDOW:
                    windowed.append((pool, group_keys))
                    continue
                in_cpu = pool.cpu_index.ready_for
                in_nvme = pool.nvme_index.ready_for if pool.nvme_index is not None else None
                for i in range(n):
                    key = group_keys[i]
                    if in_cpu(key, owner):
                        continue
                    if in_nvme is None or not in_nvme(key, owner):
                        n = i
                        break
                    from_nvme.add(i)
        except TypeError as exc:  # an unhashable "key"
            raise ChunkKeyError(f"a chunk key must be bytes: {exc}") from None
        while n and not all(self._window_ready(pool, group_keys, n, owner) for pool, group_keys in windowed):
            n -= 1
        nvme_hits = sum(1 for i in from_nvme if i < n)
        self._lookups["hit_cpu"] += n - nvme_hits
        self._lookups["hit_nvme"] += nvme_hits
        self._lookups["miss"] += asked - n
        log.debug("lookup.done", namespace=pools[0].fingerprint, n_chunks=n, asked=len(keys[0]))
        return n

    @staticmethod
    def _window_ready(pool: _Pool, keys: Sequence[ChunkKey], n_chunks: int, owner: str) -> bool:
        assert pool.window is not None
        span = window_span(n_chunks * pool.chunk_size, pool.window, pool.block_size)
        chunks = span_chunks(span, block_size=pool.block_size, chunk_size=pool.chunk_size).chunks
        try:
            return all(pool.ready_anywhere(keys[c], owner) for c in chunks)
        except TypeError as exc:
            raise ChunkKeyError(f"a chunk key must be bytes: {exc}") from None

    # -- load --------------------------------------------------------------------------
    async def load(
        self,
        namespace: Namespace,
        *,
        request_id: str,
        keys: Sequence[Sequence[ChunkKey]],
        block_ids: Sequence[Sequence[int]],
        num_tokens: int,
    ) -> int:
        """Fill the engine's GPU blocks for the first ``num_tokens`` tokens; tokens loaded.

        ``keys[g]`` are group ``g``'s chunk keys and ``block_ids[g]`` its block table from
        the prompt's first block. For a sliding-window group, ``block_ids[g]`` holds only
        the blocks of ``window_span(num_tokens, …)``, in order — the blocks the next token
        attends to, the first of which may start inside a chunk. ``num_tokens`` need not
        be chunk-aligned (engines recompute at least the prompt's last token); the last
        chunk is then copied in part. A span out of bounds is logged as ``load.rejected``
        and loads nothing. If a chunk cannot be brought in, full-attention groups keep the
        good prefix before it; a hybrid model loads all or nothing.
        """
        self._check()
        pools = self._pools_of(namespace)
        require_request_id(request_id)
        per_group(keys, len(pools), "keys", ChunkKeyError)
        tables = [require_block_ids(table) for table in per_group(block_ids, len(pools), "block_ids", BlockTableError)]
        # Events of this load, in the promotions it starts too, carry the request and namespace.
        with bound_contextvars(request_id=request_id, namespace=namespace.fingerprint_hex):
            started = self._clock()
            try:
                plans = [
                    self._plan_load(pool, namespace.fingerprint_hex, k, b, num_tokens)
                    for pool, k, b in zip(pools, keys, tables, strict=True)
                ]
                for pool, plan in zip(pools, plans, strict=True):
                    require_keys(plan.keys)
                    blocks_in_range(
                        (b for blocks in plan.blocks for b in blocks), pool.gpus[namespace.tp_rank].num_slots
                    )
            except (SpanError, BlockTableError) as exc:
                reason = "span" if isinstance(exc, SpanError) else "block_table"
                self._rejected[reason] += 1
                log.warning(
                    "load.rejected",
                    namespace=pools[0].fingerprint,
                    request_id=request_id,
                    reason=reason,
                    error=str(exc),
                )
                return 0
            log.debug("load.started", namespace=pools[0].fingerprint, request_id=request_id, n_tokens=num_tokens)
            self._loads_in_flight += 1
            sources: collections.Counter[str] = collections.Counter()
            try:
                loaded = await self._run_load(namespace.tp_rank, plans, request_id, num_tokens, sources)
            finally:
                self._loads_in_flight -= 1
            if loaded < num_tokens:
                self._rejected["transfer"] += 1
            ms = (self._clock() - started) * 1e3
            self._load_latency[bisect.bisect_left(LOAD_LATENCY_BOUNDS_MS, ms)] += 1
            self._load_ms += ms
            log.debug(
                "load.done",
                namespace=pools[0].fingerprint,
                request_id=request_id,
                n_tokens=loaded,
                chunks_from_cpu=sources["cpu"],
                chunks_from_nvme=sources["nvme"],
                ms=ms,
            )
            return loaded

    def _plan_load(
        self, pool: _Pool, namespace: str, keys: Sequence[ChunkKey], block_ids: Sequence[int], num_tokens: int
    ) -> _LoadPlan:
        k, b = pool.blocks_per_chunk, pool.block_size
        if not is_int_at_least(num_tokens, 0):
            raise SpanError(f"num_tokens must be a non-negative integer, got {num_tokens!r}")
        if num_tokens > len(keys) * pool.chunk_size:
            raise SpanError(f"{num_tokens} tokens need more than the {len(keys)} chunks whose keys were given")
        if pool.kind is not AttentionKind.SLIDING_WINDOW:
            span = range(cdiv(num_tokens, b))
            if len(block_ids) < len(span):
                raise SpanError(f"{len(block_ids)} GPU blocks given for {num_tokens} tokens ({len(span)} blocks)")
            pending = list(block_ids[: len(span)])
        else:
            assert pool.window is not None
            validate_window_span(len(block_ids), window=pool.window, block_size=b, chunk_size=pool.chunk_size)
            span = window_span(num_tokens, pool.window, b)
            if len(block_ids) != len(span):
                raise SpanError(
                    f"{len(block_ids)} pending blocks given but the window span at {num_tokens} tokens is "
                    f"{len(span)} blocks ({span.start}…{span.stop - 1})"
                )
            pending = list(block_ids)
        mapped = span_chunks(span, block_size=b, chunk_size=pool.chunk_size)
        if mapped.chunks and mapped.chunks.stop > len(keys):
            raise SpanError(f"{num_tokens} tokens need {mapped.chunks.stop} chunks but {len(keys)} keys were given")
        plan_keys, plan_blocks, firsts = [], [], []
        cursor = 0
        for i, chunk in enumerate(mapped.chunks):
            first = mapped.first_block_offset if i == 0 else 0
            count = min(k - first, len(pending) - cursor)
            plan_keys.append(keys[chunk])
            plan_blocks.append(tuple(pending[cursor : cursor + count]))
            firsts.append(first)
            cursor += count
        return _LoadPlan(pool, namespace, plan_keys, plan_blocks, firsts)

    async def _run_load(
        self, rank: int, plans: list[_LoadPlan], request_id: str, num_tokens: int, sources: collections.Counter[str]
    ) -> int:
        """Stage every plan's chunks in cpu, copy what was staged to the GPU; tokens loaded.

        Full-attention groups keep their good prefix; a sliding-window group's chunks are
        all or nothing, since a partial window is useless to the engine.
        """
        pinned: list[tuple[_Pool, ChunkKey]] = []
        pending: list[list[tuple[ChunkKey, asyncio.Task[bool] | None]]] = []
        try:
            pending += [self._start_stage(plan, pinned) for plan in plans]  # every promotion starts now
            staged = [
                await self._finish_stage(plan, steps, pinned, sources)
                for plan, steps in zip(plans, pending, strict=True)
            ]
            windowed = [plan.pool.kind is AttentionKind.SLIDING_WINDOW for plan in plans]
            complete = [len(slots) == len(plan.keys) for plan, slots in zip(plans, staged, strict=True)]
            if any(windowed) and not all(complete):
                # A window is useless in part, and a window laid out for num_tokens is
                # wrong for a shorter prefix: a hybrid model loads all or nothing.
                return 0
            async with self._gate.hold(LOAD_PRIORITY):
                for plan, slots in zip(plans, staged, strict=True):
                    pool = plan.pool
                    ops = [
                        TransferOp(buffer=pool.cpu.view(slot), key=key, blocks=blocks, first_block=first)
                        for slot, key, blocks, first in zip(
                            slots, plan.keys, plan.blocks, plan.first_blocks, strict=False
                        )
                    ]
                    if not ops:
                        continue
                    try:
                        await pool.gpus[rank].write(ops)
                    except TierError as exc:
                        self._transfer_failed("cpu->gpu", pool, request_id, exc)
                        return 0
                    block_bytes = pool.chunk_bytes // pool.blocks_per_chunk
                    self._bytes["cpu->gpu"] += block_bytes * sum(len(op.blocks) for op in ops)
            good = [
                len(slots) * plan.pool.chunk_size
                for plan, slots, is_window in zip(plans, staged, windowed, strict=True)
                if not is_window
            ]
            return min([num_tokens, *good])
        finally:
            for plan, steps in zip(plans, pending, strict=False):
                for key, task in steps:
                    if task is not None:
                        self._drop_claim(plan.pool, key, task)
            for pool, key in pinned:
                pool.cpu_index.unpin(key)

    def _start_stage(
        self, plan: _LoadPlan, pinned: list[tuple[_Pool, ChunkKey]]
    ) -> list[tuple[ChunkKey, asyncio.Task[bool] | None]]:
        """The plan's leading chunks that some tier holds: those in cpu are pinned at once,
        and a shared nvme → cpu promotion starts for each that only nvme holds."""
        pool = plan.pool
        steps: list[tuple[ChunkKey, asyncio.Task[bool] | None]] = []
        for key in plan.keys:
            if pool.cpu_index.ready_for(key, plan.namespace):
                pool.cpu_index.pin(key)
                pinned.append((pool, key))
                steps.append((key, None))
            elif pool.nvme_index is not None and pool.nvme_index.ready_for(key, plan.namespace):
                handle = (pool.fingerprint, pool.group, key)
                task = self._scheduler.shared(
                    handle, functools.partial(self._promote, pool, key), name=f"promote-{key.hex()[:8]}"
                )
                self._promotion_claims[handle] += 1  # the promotion pins the chunk for each claim
                steps.append((key, task))
            else:
                break
        return steps

    async def _finish_stage(
        self,
        plan: _LoadPlan,
        steps: list[tuple[ChunkKey, asyncio.Task[bool] | None]],
        pinned: list[tuple[_Pool, ChunkKey]],
        sources: collections.Counter[str],
    ) -> list[int]:
        """Wait for the promotions, which pin what they bring in for this load; the cpu
        slots of the leading chunks that are staged, in order. A step whose claim this
        settles is marked done in ``steps``."""
        pool = plan.pool
        slots: list[int] = []
        for i, (key, task) in enumerate(steps):
            if task is not None:
                steps[i] = (key, None)
                try:
                    promoted = await self._promoted(task)
                except BaseException:
                    self._drop_claim(pool, key, task)
                    raise
                if not promoted:
                    break
                pinned.append((pool, key))
            entry = pool.cpu_index.get(key)
            assert entry is not None
            slots.append(entry.slot)
            tier = "nvme" if task is not None else "cpu"
            self._loaded[tier] += 1
            sources[tier] += 1
            hits = pool.cpu_index.hit(key)
            if pool.policy.write_policy is WritePolicy.SELECTIVE and hits >= pool.policy.selective_hits:
                self._write_behind(pool, [key])
        return slots

    def _drop_claim(self, pool: _Pool, key: ChunkKey, task: asyncio.Task[bool]) -> None:
        """Give up a load's claim on a promotion: its pin if the chunk came in, else its
        place among the claims the promotion will pin for."""
        if not task.done():
            handle = (pool.fingerprint, pool.group, key)
            self._promotion_claims[handle] -= 1
            if self._promotion_claims[handle] <= 0:
                del self._promotion_claims[handle]
        elif not task.cancelled() and task.exception() is None and task.result():
            pool.cpu_index.unpin(key)

    @staticmethod
    async def _promoted(task: asyncio.Task[bool]) -> bool:
        """Wait for a shared promotion without letting this caller's cancellation cancel
        it for the others; a promotion cancelled by someone else (close) is a miss."""
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and current is not None and not current.cancelling():
                return False
            raise

    async def _promote(self, pool: _Pool, key: ChunkKey) -> bool:
        """Read one chunk nvme → cpu, shared by every load that claimed it; True when it is
        READY in cpu, pinned once for each claim, so that no eviction can take it between
        this task's end and its loads' next steps."""
        try:
            promoted = await self._read_into_cpu(pool, key)
        finally:
            claims = self._promotion_claims.pop((pool.fingerprint, pool.group, key), 0)
        if promoted:
            for _ in range(claims):
                pool.cpu_index.pin(key)
        return promoted

    async def _read_into_cpu(self, pool: _Pool, key: ChunkKey) -> bool:
        assert pool.nvme is not None and pool.nvme_index is not None
        if not pool.nvme_index.is_ready(key):
            return False  # evicted from nvme between the lookup and this task's start
        if pool.cpu_index.is_ready(key):
            return True  # another path brought it in meanwhile
        if key in pool.cpu_index:
            return False  # a store of it is in flight: not a hit yet
        nvme_slot = pool.nvme_index.pin(key)
        owner, namespace = pool.nvme_index.owner(key), pool.nvme_index.namespace(key)
        reservation = pool.cpu_index.reserve([key], owner, namespace)
        if reservation is None:
            pool.nvme_index.unpin(key)
            log.info("tier.full", tier="cpu", namespace=pool.fingerprint, reason="promotion")
            return False
        self._evicted(pool, "cpu", reservation.evicted)
        slot = reservation.slots[key]
        try:
            await self._spill(pool, reservation.evicted)
            async with self._disk_gate.hold(LOAD_PRIORITY):
                await pool.nvme.read([TransferOp(buffer=pool.cpu.view(slot), key=key, slot=nvme_slot)])
        except BaseException as exc:
            pool.nvme_index.unpin(key)
            pool.cpu_index.drop(key)
            if not isinstance(exc, TierError):
                raise
            self._transfer_failed("nvme->cpu", pool, None, exc)
            entry = pool.nvme_index.get(key)
            if isinstance(exc, CorruptChunk) and entry is not None and not entry.pins:
                self._drop_nvme(pool, [key])
                self._emit(pool, KVEventKind.REMOVED, "nvme", key, namespace)
            return False
        pool.nvme_index.unpin(key)
        pool.nvme_index.hit(key)
        pool.cpu_index.mark_ready(key)
        self._bytes["nvme->cpu"] += pool.chunk_bytes
        self._emit(pool, KVEventKind.STORED, "cpu", key, namespace)
        log.debug("chunk.promoted", namespace=pool.fingerprint, key=key.hex(), src="nvme", dst="cpu")
        return True

    # -- store -------------------------------------------------------------------------
    async def store(
        self,
        namespace: Namespace,
        *,
        request_id: str,
        keys: Sequence[Sequence[ChunkKey]],
        block_ids: Sequence[Sequence[int]],
    ) -> StoreResult:
        """Submit copies of full chunks out of GPU blocks; waits only for queue room.

        ``block_ids[g]`` is group ``g``'s block table from the prompt's first block; a
        negative id marks a block the engine no longer holds (a sliding-window group's
        blocks behind the window), and chunks touching one are skipped.
        """
        self._check()
        tables = self._store_tables(namespace, request_id, keys, block_ids)
        bound = sum(len(k) for k in keys)
        await self._store_budget.take(bound)
        try:
            self._check()  # closed, or failed, while this store waited for room
            pools = self._pools_of(namespace)  # still registered
        except BaseException:
            self._store_budget.give(bound)
            raise
        return self._submit_store(namespace, pools, request_id, keys, tables, bound)

    def store_nowait(
        self,
        namespace: Namespace,
        *,
        request_id: str,
        keys: Sequence[Sequence[ChunkKey]],
        block_ids: Sequence[Sequence[int]],
    ) -> StoreResult:
        """:meth:`store` that raises :class:`BusyError` instead of waiting for queue room."""
        self._check()
        tables = self._store_tables(namespace, request_id, keys, block_ids)
        bound = sum(len(k) for k in keys)
        self._store_budget.take_nowait(bound)
        return self._submit_store(namespace, self._pools_of(namespace), request_id, keys, tables, bound)

    def _store_tables(
        self, namespace: Namespace, request_id: str, keys: Sequence[Sequence[ChunkKey]], block_ids: object
    ) -> list[list[int]]:
        """Check a store's arguments before it takes queue room: every key a chunk key,
        every block id an integer, the blocks of the chunks inside the rank's KV cache.
        The block tables, as ints."""
        pools = self._pools_of(namespace)
        require_request_id(request_id)
        per_group(keys, len(pools), "keys", ChunkKeyError)
        tables = [require_block_ids(table) for table in per_group(block_ids, len(pools), "block_ids", BlockTableError)]
        for pool, group_keys, table in zip(pools, keys, tables, strict=True):
            require_keys(group_keys)
            copied = (b for b in table[: len(group_keys) * pool.blocks_per_chunk] if b >= 0)
            blocks_in_range(copied, pool.gpus[namespace.tp_rank].num_slots)
        return tables

    def _submit_store(
        self,
        namespace: Namespace,
        pools: list[_Pool],
        request_id: str,
        keys: Sequence[Sequence[ChunkKey]],
        block_ids: list[list[int]],
        taken: int,
    ) -> StoreResult:
        # Events of this store, in its background tasks too, carry the request and namespace.
        with bound_contextvars(request_id=request_id, namespace=namespace.fingerprint_hex):
            try:
                planned: list[tuple[_Pool, list[tuple[ChunkKey, tuple[int, ...]]]]] = []
                skipped = 0
                for pool, group_keys, table in zip(pools, keys, block_ids, strict=True):
                    k = pool.blocks_per_chunk
                    candidates = []
                    seen = set()
                    for c, key in enumerate(group_keys):
                        blocks = tuple(table[c * k : (c + 1) * k])
                        if len(blocks) < k or min(blocks) < 0 or key in seen or pool.resident_anywhere(key):
                            skipped += 1
                            continue
                        seen.add(key)
                        candidates.append((key, blocks))
                    copied = [block for _, blocks in candidates for block in blocks]
                    if len(set(copied)) != len(copied):
                        raise BlockTableError("a GPU block appears in two chunks to be stored")
                    chunks = candidates
                    if pool.admission is not None:
                        # Every chunk is a sighting; after one the filter turns away, the rest
                        # of the prefix would be unreachable, so none of it is stored.
                        admitted = [pool.admission.admit(key) for key, _ in candidates]
                        chunks = candidates[: admitted.index(False)] if False in admitted else candidates
                        skipped += len(candidates) - len(chunks)
                    planned.append((pool, chunks))
                reservations: list[tuple[_Pool, Reservation]] = []
                for pool, chunks in planned:
                    owner = self._owner(pool, namespace)
                    reservation = (
                        pool.cpu_index.reserve((key for key, _ in chunks), owner, namespace.fingerprint_hex)
                        if chunks
                        else None
                    )
                    if chunks and reservation is None:
                        # Nothing has been copied yet: undo the other groups' reservations,
                        # their victims included, so that a rejected store changes nothing.
                        for done_pool, done in reservations:
                            done_pool.cpu_index.unreserve(done)
                        self._stores_rejected += 1
                        log.info(
                            "tier.full",
                            tier="cpu",
                            namespace=pool.fingerprint,
                            request_id=request_id,
                            n_chunks=len(chunks),
                        )
                        log.info(
                            "store.skipped",
                            namespace=pool.fingerprint,
                            request_id=request_id,
                            reason="cannot store now",
                        )
                        self._store_budget.give(taken)
                        return StoreResult(submitted=0, skipped=skipped, rejected=True)
                    if reservation is not None:
                        reservations.append((pool, reservation))
            except BaseException:
                self._store_budget.give(taken)
                raise
            submitted = sum(len(chunks) for _, chunks in planned)
            self._store_budget.give(taken - submitted)
            for (pool, chunks), (_, reservation) in zip([(p, c) for p, c in planned if c], reservations, strict=True):
                self._evicted(pool, "cpu", reservation.evicted)
                job = _StoreJob(pool, namespace.fingerprint_hex, namespace.tp_rank, request_id, chunks)
                self._jobs[request_id].add(job)
                task = self._scheduler.spawn(
                    self._run_store(job, reservation.slots, reservation.evicted), name=f"store-{request_id}"
                )
                task.add_done_callback(functools.partial(self._store_finished, job))
            if submitted:
                log.debug("store.submitted", namespace=pools[0].fingerprint, request_id=request_id, n_chunks=submitted)
            if skipped:
                log.debug("store.skipped", namespace=pools[0].fingerprint, request_id=request_id, n_chunks=skipped)
            return StoreResult(submitted=submitted, skipped=skipped)

    def _job_done(self, job: _StoreJob) -> None:
        jobs = self._jobs[job.request_id]
        jobs.discard(job)
        if not jobs:
            del self._jobs[job.request_id]

    async def _run_store(self, job: _StoreJob, slots: dict[ChunkKey, int], evicted: list[Victim]) -> None:
        job.started = True
        pool = job.pool
        started = self._clock()
        try:
            await self._spill(pool, evicted)
            ops = [TransferOp(buffer=pool.cpu.view(slots[key]), key=key, blocks=blocks) for key, blocks in job.chunks]
            async with self._gate.hold(STORE_PRIORITY):
                await pool.gpus[job.rank].read(ops)
        except BaseException as exc:
            for key, _ in job.chunks:
                pool.cpu_index.drop(key)
            if not isinstance(exc, TierError):
                raise
            self._transfer_failed("gpu->cpu", pool, job.request_id, exc)
            return
        finally:
            # Done, failed or cancelled: no copy reads the engine's blocks any more.
            job.gpu_released.set_result(None)
        for key, _ in job.chunks:
            pool.cpu_index.mark_ready(key)
            self._emit(pool, KVEventKind.STORED, "cpu", key, job.namespace)
        self._bytes["gpu->cpu"] += pool.chunk_bytes * len(job.chunks)
        ms = (self._clock() - started) * 1e3
        log.debug("store.done", namespace=pool.fingerprint, request_id=job.request_id, n_chunks=len(job.chunks), ms=ms)
        if pool.policy.write_policy is WritePolicy.WRITE_THROUGH:
            self._write_behind(pool, [key for key, _ in job.chunks])

    def _store_finished(self, job: _StoreJob, task: asyncio.Task[None]) -> None:
        """Whatever became of a store's task, give back what its job holds. A task
        cancelled before its first step never ran ``_run_store``'s clean-up."""
        if not job.started:
            for key, _ in job.chunks:
                job.pool.cpu_index.drop(key)
            job.gpu_released.set_result(None)
        self._job_done(job)
        self._store_budget.give(len(job.chunks))

    # -- cpu → nvme --------------------------------------------------------------------
    def _write_behind(self, pool: _Pool, keys: list[ChunkKey]) -> None:
        """Copy READY cpu chunks to nvme in the background, if the bounded queue has room."""
        if pool.nvme is None or self._closed:
            return
        keys = [key for key in keys if key not in pool.nvme_index]  # type: ignore[operator]
        if not keys:
            return
        try:
            self._write_behind_budget.take_nowait(len(keys))
        except TieredKVError:
            log.info("store.skipped", tier="nvme", namespace=pool.fingerprint, n_chunks=len(keys), reason="queue full")
            return
        task = self._scheduler.spawn(self._to_nvme(pool, keys), name="write-behind")
        task.add_done_callback(lambda _: self._write_behind_budget.give(len(keys)))

    async def _to_nvme(self, pool: _Pool, keys: list[ChunkKey]) -> None:
        """Write-through and selective: copy READY cpu chunks to nvme, pinned meanwhile."""
        assert pool.nvme_index is not None
        pinned = [k for k in keys if pool.cpu_index.is_ready(k) and k not in pool.nvme_index]
        try:
            chunks = [
                Victim(key, pool.cpu_index.pin(key), pool.cpu_index.owner(key), pool.cpu_index.namespace(key))
                for key in pinned
            ]
            await self._write_nvme(pool, chunks)
        finally:
            for key in pinned:
                pool.cpu_index.unpin(key)

    async def _spill(self, pool: _Pool, evicted: list[Victim]) -> None:
        """Write-back: copy chunks the cpu tier just evicted to nvme before their slots are
        reused. Their bytes are still in the slots, which now belong to PENDING chunks."""
        if pool.policy.write_policy is not WritePolicy.WRITE_BACK or pool.nvme_index is None or not evicted:
            return
        await self._write_nvme(pool, [victim for victim in evicted if victim.key not in pool.nvme_index])

    async def _write_nvme(self, pool: _Pool, chunks: Sequence[Victim]) -> None:
        """Copy chunks from their cpu slots into nvme slots of their owners' shares;
        chunks no share has room for are skipped, failed copies dropped."""
        assert pool.nvme is not None and pool.nvme_index is not None
        ops = []
        for owner, namespace in dict.fromkeys((chunk.owner, chunk.namespace) for chunk in chunks):
            mine = [(c.key, c.slot) for c in chunks if (c.owner, c.namespace) == (owner, namespace)]
            reservation = pool.nvme_index.reserve((key for key, _ in mine), owner, namespace)
            if reservation is None:
                log.info("tier.full", tier="nvme", namespace=owner, n_chunks=len(mine))
                continue
            self._evicted(pool, "nvme", reservation.evicted)
            ops += [TransferOp(buffer=pool.cpu.view(slot), key=key, slot=reservation.slots[key]) for key, slot in mine]
        if not ops:
            return
        keys = [op.key for op in ops]
        try:
            async with self._disk_gate.hold(STORE_PRIORITY):
                await pool.nvme.write(ops)
        except BaseException as exc:
            self._drop_nvme(pool, keys)
            if not isinstance(exc, TierError):
                raise
            self._transfer_failed("cpu->nvme", pool, None, exc)
            return
        for key in keys:
            pool.nvme_index.mark_ready(key)
            self._emit(pool, KVEventKind.STORED, "nvme", key, pool.nvme_index.namespace(key))
        self._bytes["cpu->nvme"] += pool.chunk_bytes * len(keys)

    # -- request lifecycle -------------------------------------------------------------
    async def finish_request(self, request_id: str) -> None:
        """Return once no store of ``request_id`` still reads the request's GPU blocks."""
        self._check()
        require_request_id(request_id)
        await self._released([job.gpu_released for job in self._jobs.get(request_id, ())])

    def flush_nowait(self, block_ids: Iterable[int] | None = None, *, namespace: Namespace | None = None) -> bool:
        """True when no store reads any of ``block_ids`` (see :meth:`flush`) now."""
        self._check()
        return not self._reading(block_ids, namespace)

    def _reading(self, block_ids: Iterable[int] | None, namespace: Namespace | None) -> list[asyncio.Future[None]]:
        if namespace is not None:
            require_namespace(namespace)
        if block_ids is not None and not isinstance(block_ids, Iterable):
            raise BlockTableError(f"block_ids must be integers or None, got {type(block_ids).__name__}")
        wanted = None if block_ids is None else frozenset(require_block_ids(block_ids))
        return [
            job.gpu_released
            for jobs in self._jobs.values()
            for job in jobs
            if (
                namespace is None
                or (job.pool.fingerprint, job.rank) == (namespace.base.fingerprint_hex, namespace.tp_rank)
            )
            and (wanted is None or not wanted.isdisjoint(job.blocks))
        ]

    def finish_request_nowait(self, request_id: str) -> bool:
        """True when the request's GPU blocks may be freed now (no store reads them)."""
        self._check()
        return require_request_id(request_id) not in self._jobs

    async def flush(self, block_ids: Iterable[int] | None = None, *, namespace: Namespace | None = None) -> None:
        """Return once no store reads any of ``block_ids`` (all blocks when ``None``) of
        ``namespace``'s rank (every registered rank when ``None``)."""
        self._check()
        await self._released(self._reading(block_ids, namespace))

    async def _released(self, waiting: list[asyncio.Future[None]]) -> None:
        """Wait for stores to stop reading GPU blocks; the caller's cancellation does not
        cancel the stores."""
        if waiting:
            await asyncio.shield(asyncio.gather(*waiting))
        self._check()

    async def drain(self) -> None:
        """Return once every background copy (stores, write-behind, promotions) is done."""
        self._check()
        await self._scheduler.drain()
        self._check()

    # -- observation -------------------------------------------------------------------
    def statistics(self) -> Statistics:
        tiers = []
        for name in ("cpu", "nvme"):
            indexes = [
                (pool.cpu_index if name == "cpu" else pool.nvme_index, pool.chunk_bytes)
                for pool in self._pools.values()
            ]
            present = [(index, size) for index, size in indexes if index is not None]
            if not present:
                continue
            tiers.append(
                TierUsage(
                    tier=name,
                    capacity_chunks=sum(index.num_slots for index, _ in present),
                    used_chunks=sum(index.used for index, _ in present),
                    pinned_chunks=sum(index.pinned for index, _ in present),
                    capacity_bytes=sum(index.num_slots * size for index, size in present),
                    used_bytes=sum(index.used * size for index, size in present),
                )
            )
        shares = [
            NamespaceUsage(
                namespace=owner,
                model_id=pool.model_id,
                tier=index.tier,
                group=pool.group,
                used_chunks=index.partition.usage(owner),
                quota_chunks=index.partition.quota(owner),
            )
            for pool in self._pools.values()
            for index in (pool.cpu_index, pool.nvme_index)
            if index is not None
            for owner in index.partition.namespaces()
        ]
        return Statistics(
            tiers=tiers,
            namespaces=shares,
            lookups=dict(self._lookups),
            loaded_chunks=dict(self._loaded),
            load_latency=LatencyHistogram(
                bounds_ms=LOAD_LATENCY_BOUNDS_MS,
                counts=list(self._load_latency),
                sum_ms=self._load_ms,
                count=sum(self._load_latency),
            ),
            bytes_moved=dict(self._bytes),
            queue_depths={
                "stores": self._store_budget.used,
                "write_behind": self._write_behind_budget.used,
                "loads": self._loads_in_flight,
                "copies_waiting": self._gate.waiting,
                "nvme_io_waiting": self._disk_gate.waiting,
                "background_tasks": self._scheduler.background,
            },
            loads_rejected=dict(self._rejected),
            stores_rejected=self._stores_rejected,
            events_dropped=self._events_dropped,
            drivers=[driver.statistics() for driver in self._drivers()],
        )

    def _drivers(self) -> list[TierDriver]:
        drivers: list[TierDriver] = []
        for pool in self._pools.values():
            drivers += [*pool.gpus.values(), pool.cpu] + ([pool.nvme] if pool.nvme else [])
        return list(dict.fromkeys(drivers))

    def drain_events(self, max_events: int | None = None) -> list[KVEvent]:
        """Take up to ``max_events`` KV events (all when ``None``), oldest first."""
        count = len(self._events) if max_events is None else min(max_events, len(self._events))
        return [self._events.popleft() for _ in range(count)]

    def check_invariants(self) -> None:
        """Raise if any residency index contradicts itself (for tests and debugging)."""
        for pool in self._pools.values():
            pool.cpu_index.check()
            if pool.nvme_index is not None:
                pool.nvme_index.check()

    # -- helpers -----------------------------------------------------------------------
    def _emit(self, pool: _Pool, kind: KVEventKind, tier: str, key: ChunkKey, namespace: str) -> None:
        if len(self._events) == self._events.maxlen:
            self._events_dropped += 1
        self._events.append(KVEvent(kind=kind, tier=tier, namespace=namespace, group=pool.group, key=key))

    def _evicted(self, pool: _Pool, tier: str, evicted: list[Victim]) -> None:
        for victim in evicted:
            self._emit(pool, KVEventKind.REMOVED, tier, victim.key, victim.namespace)
        if evicted:
            log.debug("chunk.evicted", namespace=pool.fingerprint, tier=tier, n_chunks=len(evicted))

    @staticmethod
    def _drop_nvme(pool: _Pool, keys: list[ChunkKey]) -> None:
        """Forget nvme chunks whose bytes cannot be trusted (failed write, corrupt read)."""
        assert pool.nvme is not None and pool.nvme_index is not None
        pool.nvme.forget([pool.nvme_index.drop(key) for key in keys])

    def _transfer_failed(self, path: str, pool: _Pool, request_id: str | None, exc: TierError) -> None:
        # Background copies (write-behind, promotions) serve no single request; theirs is
        # whatever the contextvars of the task that started them say.
        fields = {"request_id": request_id} if request_id is not None else {}
        log.warning(
            "transfer.failed",
            path=path,
            namespace=pool.fingerprint,
            error=str(exc),
            reason=type(exc).__name__,
            **fields,
        )


class RegistryTiers:
    """The default :class:`TierFactory`: the drivers registered as ``gpu``, ``cpu``, ``nvme``."""

    def gpu(self, namespace: Namespace, group: int, tensors: Sequence[torch.Tensor]) -> TierDriver:
        driver: TierDriver = TIERS.get("gpu")(tensors, blocks_per_chunk=namespace.geometry.blocks_per_chunk)  # type: ignore[operator]
        return driver

    def cpu(self, namespace: Namespace, group: int, slot_bytes: int, num_slots: int) -> HostTier:
        driver: HostTier = TIERS.get("cpu")(slot_bytes, num_slots)  # type: ignore[operator]
        return driver

    async def nvme(
        self, namespace: Namespace, group: int, slot_bytes: int, num_slots: int, config: NvmeTierConfig
    ) -> RecoverableTier:
        opener = TIERS.get("nvme").open  # type: ignore[attr-defined]
        driver: RecoverableTier = await opener(
            config.root, namespace, slot_bytes=slot_bytes, num_slots=num_slots, io_depth=config.io_depth, group=group
        )
        return driver

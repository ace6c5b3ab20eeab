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

``TieredKV`` runs both planes in one process: the :class:`~tiered_kv.control.ControlPlane`
decides (residency, tenants, which slots, which victims) and returns plans; this module
carries them out on the tier drivers — the data plane — under the scheduler's gates and
budgets, and reports each outcome back. Every exit path, failure or cancellation, reports
too, so the indexes are consistent at every ``await``.

With a remote tier (``[remote]``), lookups count chunks it likely holds, loads promote
them into cpu like nvme chunks, stores reach it per write policy, and background probes
(batched ``EXISTS``) tell the residency hint what other engines stored.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import itertools
import time
from collections.abc import Callable, Iterable, Sequence

import msgspec
import torch

from tiered_kv.arguments import (
    blocks_in_range,
    per_group,
    require_block_ids,
    require_flushed_blocks,
    require_keys,
    require_namespace,
    require_request_id,
)
from tiered_kv.checks import is_int_at_least
from tiered_kv.config import NamespacePolicyConfig, NvmeTierConfig, RemoteTierConfig, TieredKVConfig, WritePolicy
from tiered_kv.control import (
    RESTORE_BATCH,
    ControlPlane,
    NvmeWrite,
    Pool,
    Promotion,
    PromotionOutcome,
    RemotePromotion,
    RemoteWrite,
    StoreGroup,
)
from tiered_kv.directory import Victim
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
from tiered_kv.interfaces import (
    HandsOverRecovered,
    HostTier,
    RecoverableTier,
    RemoteTier,
    TierDriver,
    TierFactory,
    TransferOp,
)
from tiered_kv.keys import ChunkKey
from tiered_kv.layout import AttentionKind
from tiered_kv.log import bound_to_call, get_logger
from tiered_kv.namespace import Namespace
from tiered_kv.registry import ADMISSION_FILTERS, POLICIES, TIERS
from tiered_kv.scheduler import LOAD_PRIORITY, STORE_PRIORITY, Budget, PriorityGate, Scheduler, wait_out
from tiered_kv.spans import cdiv, span_chunks, validate_window_span, window_span
from tiered_kv.stats import KVEvent, RemotePoolStatistics, Statistics
from tiered_kv.telemetry import Telemetry

log = get_logger("manager")


class StoreResult(msgspec.Struct, frozen=True, kw_only=True):
    #: Chunks whose copies were submitted.
    submitted: int
    #: Chunks skipped because some tier already holds (or is writing) them.
    skipped: int
    #: True when nothing could be evicted to make room: nothing was submitted or changed.
    rejected: bool = False


class _Drivers:
    """The data plane of one pool: its cpu slab, maybe its nvme store and remote tier,
    and each registered rank's GPU tensors."""

    __slots__ = ("cpu", "gpus", "nvme", "remote")

    def __init__(self, cpu: HostTier, nvme: RecoverableTier | None, remote: RemoteTier | None = None) -> None:
        self.cpu = cpu
        self.nvme = nvme
        self.remote = remote
        self.gpus: dict[int, TierDriver] = {}

    def stores(self) -> list[TierDriver]:
        """The drivers that keep chunks (all but the GPU ones), in the order they close:
        the cpu tier last, since the others copy to and from its slots, and closing it
        gives its slab's pages back."""
        return [*([self.nvme] if self.nvme else []), *([self.remote] if self.remote else []), self.cpu]


#: How many times a shutdown step that a host's cancel-all ended before it began is started.
SHUT_DOWN_STARTS = 3


async def _close_drivers(drivers: Iterable[TierDriver]) -> list[BaseException]:
    """Close each of ``drivers`` to its end, and the rest after it, even when the awaiting
    task is cancelled meanwhile (the cancellation is absorbed: the caller is closing, or
    raising what ended its opening); the failures, logged. A driver's close that the host
    cancelled itself has released what it held in its own clean-up."""
    failures: list[BaseException] = []
    for driver in drivers:
        for _ in range(SHUT_DOWN_STARTS):  # again when cancelled before it began (one begun returns at once)
            closing = asyncio.ensure_future(driver.close())
            await wait_out([closing])
            if not closing.cancelled():
                break
        if not closing.cancelled() and (exc := closing.exception()) is not None:
            log.error("driver.close_failed", tier=driver.name, error=repr(exc))
            failures.append(exc)
    return failures


class _StoreJob:
    """One KV group's chunks of one store call being copied out of one rank's GPU blocks."""

    def __init__(self, group: StoreGroup, namespace: Namespace, request_id: str) -> None:
        self.group = group
        #: The namespace storing (the tenant the chunks belong to) and its rank.
        self.namespace = namespace
        self.rank = namespace.tp_rank
        self.request_id = request_id
        #: No copy of this job reads GPU blocks any more (done, failed or cancelled).
        self.released = False
        self._waiter: asyncio.Future[None] | None = None

    @property
    def gpu_released(self) -> asyncio.Future[None]:
        """Resolved once :attr:`released`. Made when first asked for, on the loop: most
        jobs finish before anyone waits."""
        if self._waiter is None:
            self._waiter = asyncio.get_running_loop().create_future()
            if self.released:
                self._waiter.set_result(None)
        return self._waiter

    def release_gpu(self) -> None:
        """No copy of this job reads GPU blocks any more."""
        self.released = True
        if self._waiter is not None:
            self._waiter.set_result(None)

    @functools.cached_property
    def blocks(self) -> frozenset[int]:
        """The GPU blocks the job reads (for :meth:`TieredKV.flush`; built on first use)."""
        return frozenset(block for _, blocks in self.group.chunks for block in blocks)


@dataclasses.dataclass(slots=True)
class _LoadPlan:
    """One group's part of a load: chunk keys in order and where each lands on the GPU."""

    pool: Pool
    #: The fingerprint of the namespace loading: only its own chunks are staged.
    namespace: str
    #: That namespace (the remote tier binds its chunks' names to it).
    tenant: Namespace
    keys: list[ChunkKey]
    blocks: list[tuple[int, ...]]
    first_blocks: list[int]


class _Stage:
    """How a load stages one plan's chunks in cpu: the leading run READY there (pinned),
    then the chunks after it in order, each with the shared promotion that brings it in
    (``None``: it was in cpu, pinned, or its promotion's claim is settled)."""

    __slots__ = ("in_cpu", "promoted")

    def __init__(self, in_cpu: list[ChunkKey]) -> None:
        self.in_cpu = in_cpu
        self.promoted: list[tuple[ChunkKey, asyncio.Task[str | None] | None]] = []


class TieredKV:
    """Tiered KV-cache offloading for one engine process; use as ``async with``."""

    def __init__(
        self,
        config: TieredKVConfig,
        *,
        tiers: TierFactory | None = None,
        max_store_chunks: int = 4096,
        max_write_behind_chunks: int = 4096,
        max_remote_write_chunks: int = 4096,
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
            ("max_remote_write_chunks", max_remote_write_chunks),
            ("copy_concurrency", copy_concurrency),
            ("max_events", max_events),
            ("max_tenants", max_tenants),
        ):
            if not is_int_at_least(value, 1):
                raise ConfigError(f"must be a positive integer, got {value!r}", field=name)
        self.config = config
        self._tiers: TierFactory = tiers if tiers is not None else RegistryTiers()
        self._clock = clock
        self._telemetry = Telemetry(max_events)
        self._control = ControlPlane(self._telemetry, max_tenants=max_tenants, clock=clock)
        self._drivers: dict[tuple[str, int], _Drivers] = {}
        #: Ranks registered per base namespace fingerprint.
        self._ranks: dict[str, set[int]] = {}
        #: The pools of each registered (base namespace fingerprint, rank).
        self._registered: dict[tuple[str, int], list[Pool]] = {}
        #: Pools being opened, by base namespace fingerprint: replicated ranks registering at
        #: once share one opening, and a registration cancelled midway leaves it to finish.
        self._opening: dict[str, asyncio.Task[None]] = {}
        #: Pools opened per model across its tensor-parallel ranks (see _open_pools).
        self._ranks_opened: collections.Counter[str] = collections.Counter()
        self._cpu_left = config.cpu.capacity_bytes
        self._nvme_left = config.nvme.capacity_bytes if config.nvme else 0
        self._scheduler = Scheduler()
        #: GPU copy jobs at once, and nvme I/O calls at once; loads go first at both.
        self._gate = PriorityGate(copy_concurrency)
        self._disk_gate = PriorityGate(config.nvme.io_depth if config.nvme else 1)
        self._store_budget = Budget(max_store_chunks, "store queue (chunks)")
        self._write_behind_budget = Budget(max_write_behind_chunks, "nvme write-behind queue (chunks)")
        remote = config.remote
        #: Remote calls at once (loads and probes first), and chunks queued to be written there.
        self._remote_gate = PriorityGate(remote.io_depth if remote else 1)
        self._remote_write_budget = Budget(max_remote_write_chunks, "remote write queue (chunks)")
        #: Namespaces (tenants) seen lately, by fingerprint, at most ``4 × max_tenants``: the
        #: remote tier's calls name the tenant, and a write-back spill or a probe knows only
        #: its fingerprint. A tenant forgotten here is not spilled or probed for.
        self._tenants: collections.OrderedDict[str, Namespace] = collections.OrderedDict()
        self._max_known_tenants = 4 * max_tenants
        #: Pools whose probe task is running.
        self._probing: set[tuple[str, int]] = set()
        #: Store jobs still reading GPU blocks, by request.
        self._jobs: dict[str, set[_StoreJob]] = collections.defaultdict(set)
        self._loads_in_flight = 0
        self._closed = False
        self._shutting_down: asyncio.Task[None] | None = None
        self._shut_down_began = False
        #: Set once every driver is closed: what failed to close.
        self._close_failures: list[BaseException] | None = None
        #: What :meth:`statistics` says once closed: the figures when the drivers had closed.
        self._closed_statistics: Statistics | None = None

    # -- lifecycle ---------------------------------------------------------------------
    async def __aenter__(self) -> TieredKV:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        await self.close(drain=exc_type is None)

    async def close(self, *, drain: bool = True) -> None:
        """Finish (or, with ``drain=False``, cancel) background copies, then close every
        driver. Raises the first fatal background error, if one happened."""
        if self._closed:
            await self._shut_down_to_the_end()  # a close that a cancellation cut short
            return
        try:
            if drain and self._scheduler.fatal is None:
                await self._scheduler.drain()  # write-behind may still start copies here
        finally:
            self._closed = True
            self._scheduler.cancel()  # no background copy gets another step
            self._start_shut_down()  # a caller's deadline leaves it running
        failures = await self._shut_down_to_the_end()
        if failures:
            raise failures[0]
        self._scheduler.check()

    def _start_shut_down(self) -> None:
        self._shut_down_began = False
        self._shutting_down = asyncio.ensure_future(self._shut_down())

    async def _shut_down_to_the_end(self) -> list[BaseException]:
        """Wait for the drivers' shutdown; the drivers' failures to close.

        Once begun, the shutdown task finishes on its own (it sees every step through
        when cancelled), so a caller cancelled meanwhile leaves it running. A host's
        cancel-all (``asyncio.run`` on Ctrl-C) may cancel it before it began, which ends
        it at once: it is started again, and this caller, though cancelled with it,
        waits for it (``asyncio.run`` waits for the tasks it cancelled, not for one
        started after) and raises the cancellation after."""
        cancelled = False
        starts = 1
        while True:
            task = self._shutting_down
            assert task is not None, "close started it"
            if task.done() and not self._shut_down_began:
                if starts == SHUT_DOWN_STARTS:
                    raise TieredKVError(f"the shutdown was cancelled before it began {starts} times")
                starts += 1
                self._start_shut_down()
                continue
            if task.done():
                break
            try:
                await asyncio.wait([task])
            except asyncio.CancelledError:
                if self._shut_down_began:
                    raise
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError
        if self._close_failures is None:
            task.result()  # it ended by an error of its own: raised here
        return self._close_failures or []

    async def _shut_down(self) -> None:
        """Stop background copies, then close every driver, even after one fails to close
        (the failures are kept for :meth:`close`). A cancellation meanwhile cuts none of
        it short."""
        self._shut_down_began = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._scheduler.close()  # which finishes its tasks' unwinding first
        # Promotions cancelled before their first step never settled their loads' claims.
        for pool in self._control.pools.values():
            pool.claims.clear()
        # A registration still opening pools commits them (and so hands them over to be
        # closed below) or fails and closes what it opened.
        await wait_out(self._opening.values())
        failures = await _close_drivers(self._all_drivers())
        self._closed_statistics = self.statistics()
        # A closed manager holds nothing: its indexes and policies let go of their keys a
        # step at a time, never a million in one step of the loop. Not while a caller's
        # load is still in flight (it unpins its chunks when it ends): they are then
        # freed with the manager, as is what a cancellation leaves.
        if not self._loads_in_flight:
            with contextlib.suppress(asyncio.CancelledError):
                for _ in self._control.close_pools():
                    await asyncio.sleep(0)
        self._close_failures = failures  # last: an error before it is the task's, which close raises

    def _check(self) -> None:
        if self._closed:
            raise TieredKVError("TieredKV is closed")
        self._scheduler.check()

    def __repr__(self) -> str:
        tiers, _ = self._control.usage()
        usage = " ".join(f"{tier.tier}={tier.used_chunks}/{tier.capacity_chunks}" for tier in tiers)
        hints = [pool.hint for pool in self._control.pools.values() if pool.hint is not None]
        if hints:  # what the remote tier likely holds for us: a guess, hence the ~
            usage += f" remote~{sum(map(len, hints))}"
        inflight = sum(map(len, self._jobs.values())) + self._loads_in_flight
        return f"<TieredKV {usage or 'unregistered'} inflight={inflight}>"

    # -- registration ------------------------------------------------------------------
    async def register(self, namespace: Namespace, kv_caches: Sequence[Sequence[torch.Tensor]]) -> None:
        """Attach one rank's GPU KV tensors, one list per KV group (each ``[num_blocks, …]``).

        The first registration of a namespace fingerprint creates its pools, taking
        ``cpu_bytes``/``nvme_bytes`` of its namespace config (default: all capacity left);
        a replicated namespace's other ranks join the same pools.
        """
        self._check()
        geometry = require_namespace(namespace).geometry
        kv_caches = per_group(kv_caches, len(geometry.groups), "kv_caches", ConfigError)
        for group, tensors in enumerate(kv_caches):
            if not tensors or not all(isinstance(t, torch.Tensor) and t.dim() > 0 and len(t) > 0 for t in tensors):
                raise ConfigError(f"group {group}: expected non-empty tensors [num_blocks, …]", field="kv_caches")
        base = namespace.base
        if base.fingerprint_hex not in self._ranks:
            await self._pools_opened(base)
        self._check()  # closed while the pools opened
        ranks = self._ranks[base.fingerprint_hex]
        if namespace.tp_rank in ranks:
            raise ConfigError(f"rank {namespace.tp_rank} of {namespace.model_id} is already registered")
        gpus: list[TierDriver] = []
        try:
            for group, tensors in enumerate(kv_caches):
                try:
                    gpus.append(self._tiers.gpu(base, group, tensors))
                except (ValueError, TypeError, IndexError, RuntimeError) as exc:
                    raise ConfigError(f"group {group}: {exc}", field="kv_caches") from exc
                if gpus[-1].slot_bytes != geometry.block_bytes(group):
                    raise ConfigError(
                        f"group {group}: the tensors hold {gpus[-1].slot_bytes} bytes per block, the namespace's "
                        f"geometry {geometry.block_bytes(group)}",
                        field="kv_caches",
                    )
        except BaseException:
            await _close_drivers(gpus)
            raise
        for group, gpu in enumerate(gpus):
            self._drivers[(base.fingerprint_hex, group)].gpus[namespace.tp_rank] = gpu
        ranks.add(namespace.tp_rank)
        self._registered[(base.fingerprint_hex, namespace.tp_rank)] = self._control.pools_of(base)
        log.info(
            "namespace.registered", namespace=base.fingerprint_hex, model=namespace.model_id, rank=namespace.tp_rank
        )

    async def _pools_opened(self, base: Namespace) -> None:
        """Open ``base``'s pools, or wait for their opening by another registration. The
        opening is shielded from the caller's cancellation: files and threads half opened
        are never dropped; the pools are then there for the registration's retry."""
        opening = self._opening.get(base.fingerprint_hex)
        if opening is None:
            opening = asyncio.ensure_future(self._open_pools(base))
            self._opening[base.fingerprint_hex] = opening
            opening.add_done_callback(functools.partial(self._opened, base.fingerprint_hex))
        await asyncio.shield(opening)

    def _opened(self, fingerprint: str, task: asyncio.Task[None]) -> None:
        del self._opening[fingerprint]
        if not task.cancelled():
            task.exception()  # seen here too: a registration cancelled meanwhile will not see it

    async def _open_pools(self, base: Namespace) -> None:
        policy = self.config.policy_for(base.model_id)
        geometry = base.geometry
        all_groups_bytes = sum(geometry.chunk_bytes(g) for g in range(len(geometry.groups)))
        # Budgets not configured are the capacity left, shared by the model's ranks still to
        # come (each tensor-parallel rank of a layout that is not replicated has its own pools).
        model = msgspec.structs.replace(base, tp_rank=0).fingerprint_hex
        ranks_to_come = 1 if base.replicated else max(1, base.tp_size - self._ranks_opened[model])
        cpu_budget = self._take_budget("cpu", policy.cpu_bytes, self._cpu_left, ranks_to_come)
        nvme_budget = 0
        if self.config.nvme is not None:
            nvme_budget = self._take_budget("nvme", policy.nvme_bytes, self._nvme_left, ranks_to_come)
        # Every group holds the same number of chunks: a token chunk is cached in all of them.
        cpu_slots = cpu_budget // all_groups_bytes
        nvme_slots = nvme_budget // all_groups_bytes
        if cpu_slots == 0:
            raise ConfigError(
                f"cpu budget {cpu_budget} B cannot hold one chunk of {base.model_id} ({all_groups_bytes} B)",
                field="cpu_bytes",
            )
        # Reserved before the first await, so that registrations opening pools meanwhile
        # share what is left with this one; given back if the opening fails.
        self._cpu_left -= cpu_budget
        self._nvme_left -= nvme_budget
        self._ranks_opened[model] += 1
        opened: list[_Drivers] = []
        try:
            # The first registration in a process finds and imports the plug-ins: off the loop.
            await asyncio.to_thread(self._plugins_loaded, policy)
            for group in range(len(geometry.groups)):
                opened.append(await self._open_drivers(base, group, cpu_slots, nvme_slots))
            pools = self._control.add_pools(base, policy, cpu_slots, nvme_slots, self.config.remote)
            try:
                for pool, drivers in zip(pools, opened, strict=True):
                    if drivers.nvme is not None:
                        await self._restore(pool, drivers.nvme)
            except BaseException:
                self._control.remove_pools(base)
                raise
        except BaseException:
            # A failed registration leaves nothing: its drivers closed, its budget given back.
            self._cpu_left += cpu_budget
            self._nvme_left += nvme_budget
            self._ranks_opened[model] -= 1
            await _close_drivers(driver for drivers in opened for driver in drivers.stores())
            raise
        for pool, drivers in zip(pools, opened, strict=True):
            self._drivers[pool.id] = drivers
            log.info(
                "pool.opened",
                namespace=pool.fingerprint,
                group=pool.group,
                cpu_chunks=cpu_slots,
                nvme_chunks=nvme_slots,
                recovered=len(pool.nvme) if pool.nvme is not None else 0,
                remote=drivers.remote is not None,
            )
        self._ranks[base.fingerprint_hex] = set()

    def _plugins_loaded(self, policy: NamespacePolicyConfig) -> None:
        """Load the drivers and policies an opening of pools under ``policy`` asks the
        registries for (run in a thread: see :meth:`Registry.preload`)."""
        if isinstance(self._tiers, RegistryTiers):  # another factory may never ask the registry
            tiers = ["gpu", "cpu"]
            if self.config.nvme is not None:
                tiers.append("nvme")
            if self.config.remote is not None:
                tiers.append("remote")
            TIERS.preload(tiers)
        POLICIES.preload([policy.policy])
        if policy.admission is not None:
            ADMISSION_FILTERS.preload([policy.admission])

    async def _restore(self, pool: Pool, driver: RecoverableTier) -> None:
        """A warm restart's chunks into the pool's nvme index, a batch at a time, giving the
        event loop back between batches: a store of a million chunks must not hold it.
        The index takes the driver's map over where the driver gives it away (it built
        the map off the loop); otherwise each batch adds its chunks to the index's own."""
        # Taken a batch at a time from the map itself: a copy of a million keys would hold
        # the loop for tens of ms. Nothing changes the map meanwhile (the pool serves no
        # call before register returns).
        if isinstance(driver, HandsOverRecovered):
            taken = driver.take_recovered()
            # Off the loop: the policy sizes its tables for what comes, touching every page.
            await asyncio.to_thread(self._control.begin_restore, pool, taken)
            keys, slots = iter(taken), taken.values()
        else:
            recovered = driver.recovered()
            self._control.begin_restore(pool)
            keys, slots = iter(recovered), iter(recovered.values())
        while batch := list(itertools.islice(keys, RESTORE_BATCH)):
            self._control.restore(pool, batch, list(itertools.islice(slots, len(batch))))
            await asyncio.sleep(0)
        for _ in self._control.settling(pool):
            await asyncio.sleep(0)

    async def _open_drivers(self, base: Namespace, group: int, cpu_slots: int, nvme_slots: int) -> _Drivers:
        chunk_bytes = base.geometry.chunk_bytes(group)
        # Allocating the slab (with CUDA: page-locking it) takes time in proportion to the
        # tier: off the loop. The opening task is never cancelled, so the slab is not lost.
        cpu = await asyncio.to_thread(self._tiers.cpu, base, group, chunk_bytes, cpu_slots)
        drivers = _Drivers(cpu, None)
        try:
            if self.config.nvme is not None and nvme_slots:
                drivers.nvme = await self._tiers.nvme(base, group, chunk_bytes, nvme_slots, self.config.nvme)
            remote = self.config.remote
            if remote is not None:
                drivers.remote = await self._tiers.remote(base, group, chunk_bytes, remote.hint_chunks, remote)
        except BaseException:
            await _close_drivers(drivers.stores())
            raise
        return drivers

    def _take_budget(self, tier: str, wanted: int | None, left: int, sharers: int) -> int:
        """``wanted`` bytes of what is ``left``, or when not configured ``left``'s share
        for one of ``sharers``."""
        if wanted is None:
            return left // sharers
        if wanted > left:
            raise ConfigError(f"{wanted} B of {tier} requested but only {left} B are unassigned", field=f"{tier}_bytes")
        return wanted

    def _pools_of(self, namespace: Namespace) -> list[Pool]:
        """``namespace``'s pools, once its rank registered (every call asks: one dict probe)."""
        try:
            return self._registered[(namespace.base_fingerprint_hex, namespace.tp_rank)]
        except (KeyError, AttributeError):
            self._control.pools_of(namespace)  # NamespaceError: not a Namespace, or not registered
            raise NamespaceError(f"namespace {namespace.model_id} rank {namespace.tp_rank} is not registered") from None

    # -- lookup ------------------------------------------------------------------------
    def lookup(self, namespace: Namespace, keys: Sequence[Sequence[ChunkKey]]) -> int:
        """How many leading chunks can be loaded now: every full-attention (and MLA) group
        holds chunks ``0 … n−1`` ready and every sliding-window group holds the chunks its
        window at ``n`` chunks overlaps. A chunk whose store is in flight is not a hit, nor
        is one another namespace stored.

        A chunk the remote tier likely holds counts, without a network round trip: the
        load may find it gone and then returns fewer tokens. Where the run stops at a
        chunk no tier knows of, a background probe asks the remote tier about it and the
        chunks after it, so a later lookup sees what other engines stored.

        The keys are not checked one by one, as ``load`` and ``store`` check them: this is
        the engine's call for every waiting request at every step, and a value that is
        not a chunk key (not 16 ``bytes``) matches no chunk, so the run stops there."""
        if self._closed or self._scheduler.fatal is not None:
            self._check()
        pools = self._pools_of(namespace)
        if not (len(pools) == 1 and type(keys) is list and len(keys) == 1 and type(keys[0]) is list):
            keys = per_group(keys, len(pools), "keys", ChunkKeyError)  # not one list of one group's keys
        found = self._control.lookup(namespace, keys, pools)
        if pools[0].hint is not None:
            self._know_tenant(namespace)
            for pool in pools:
                if pool.hint is not None and pool.hint.probes_pending and pool.id not in self._probing:
                    self._start_probes(pool)
        return found

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
        keys = per_group(keys, len(pools), "keys", ChunkKeyError)
        tables = [
            require_block_ids(table)
            for table in per_group(block_ids, len(pools), "block_ids", BlockTableError, arrays=True)
        ]
        # Events of this load, in the promotions it starts too, carry the request and namespace.
        with bound_to_call(request_id=request_id, namespace=namespace.fingerprint_hex):
            started = self._clock()
            try:
                plans = [
                    self._plan_load(pool, namespace, k, b, num_tokens)
                    for pool, k, b in zip(pools, keys, tables, strict=True)
                ]
                for pool, plan, table in zip(pools, plans, tables, strict=True):
                    require_keys(plan.keys)
                    gpu = self._drivers[pool.id].gpus[namespace.tp_rank]
                    filled = sum(map(len, plan.blocks))  # the blocks the plan fills lead the table
                    blocks_in_range(table, filled, gpu.num_slots, distinct="to be loaded")
            except (SpanError, BlockTableError) as exc:
                reason = "span" if isinstance(exc, SpanError) else "block_table"
                self._telemetry.loads_rejected[reason] += 1
                log.warning(
                    "load.rejected",
                    namespace=pools[0].fingerprint,
                    request_id=request_id,
                    reason=reason,
                    error=str(exc),
                )
                return 0
            log.debug("load.started", namespace=pools[0].fingerprint, request_id=request_id, n_tokens=num_tokens)
            if pools[0].hint is not None:
                self._know_tenant(namespace)
            self._loads_in_flight += 1
            sources = dict.fromkeys(("cpu", "nvme", "remote"), 0)  # chunks staged from each tier
            try:
                loaded = await self._run_load(namespace.tp_rank, plans, request_id, num_tokens, sources)
            finally:
                self._loads_in_flight -= 1
            if loaded < num_tokens:
                self._telemetry.loads_rejected["transfer"] += 1
            ms = (self._clock() - started) * 1e3
            self._telemetry.load_timed(ms)
            log.debug(
                "load.done",
                namespace=pools[0].fingerprint,
                request_id=request_id,
                n_tokens=loaded,
                chunks_from_cpu=sources["cpu"],
                chunks_from_nvme=sources["nvme"],
                chunks_from_remote=sources["remote"],
                ms=ms,
            )
            return loaded

    @staticmethod
    def _plan_load(
        pool: Pool, namespace: Namespace, keys: Sequence[ChunkKey], block_ids: list[int], num_tokens: int
    ) -> _LoadPlan:
        k, b = pool.blocks_per_chunk, pool.block_size
        if not is_int_at_least(num_tokens, 0):
            raise SpanError(f"num_tokens must be a non-negative integer, got {num_tokens!r}")
        if num_tokens > len(keys) * pool.chunk_size:
            raise SpanError(f"{num_tokens} tokens need more than the {len(keys)} chunks whose keys were given")
        if pool.kind is not AttentionKind.SLIDING_WINDOW:
            # The prompt's blocks from its first: chunk c is blocks c·k … c·k + k − 1, the
            # last one cut short (the check above bounds the chunks by the keys).
            num_blocks = cdiv(num_tokens, b)
            if len(block_ids) < num_blocks:
                raise SpanError(f"{len(block_ids)} GPU blocks given for {num_tokens} tokens ({num_blocks} blocks)")
            starts = range(0, num_blocks, k)
            filled = block_ids[:num_blocks]
            plan_blocks = [tuple(filled[start : start + k]) for start in starts]
            return _LoadPlan(
                pool, namespace.fingerprint_hex, namespace, list(keys[: len(starts)]), plan_blocks, [0] * len(starts)
            )
        assert pool.window is not None
        validate_window_span(len(block_ids), window=pool.window, block_size=b, chunk_size=pool.chunk_size)
        span = window_span(num_tokens, pool.window, b)
        if len(block_ids) != len(span):
            raise SpanError(
                f"{len(block_ids)} pending blocks given but the window span at {num_tokens} tokens is "
                f"{len(span)} blocks ({span.start}…{span.stop - 1})"
            )
        mapped = span_chunks(span, block_size=b, chunk_size=pool.chunk_size)
        if mapped.chunks and mapped.chunks.stop > len(keys):
            raise SpanError(f"{num_tokens} tokens need {mapped.chunks.stop} chunks but {len(keys)} keys were given")
        # Chunk by chunk, each its blocks of the span in turn; the first may start inside
        # its chunk, so it takes fewer, and the last may be cut short.
        first = mapped.first_block_offset
        window_starts = [0, *range(k - first, len(block_ids), k)][: len(mapped.chunks)]
        plan_blocks = [
            tuple(block_ids[start : start + (k - first if i == 0 else k)]) for i, start in enumerate(window_starts)
        ]
        firsts = [first] + [0] * (len(window_starts) - 1) if window_starts else []
        plan_keys = [keys[chunk] for chunk in mapped.chunks]
        return _LoadPlan(pool, namespace.fingerprint_hex, namespace, plan_keys, plan_blocks, firsts)

    async def _run_load(
        self, rank: int, plans: list[_LoadPlan], request_id: str, num_tokens: int, sources: dict[str, int]
    ) -> int:
        """Stage every plan's chunks in cpu, copy what was staged to the GPU; tokens loaded.

        Full-attention groups keep their good prefix; a sliding-window group's chunks are
        all or nothing, since a partial window is useless to the engine.
        """
        pinned: list[tuple[Pool, list[ChunkKey]]] = []  # runs of keys pinned in a pool's cpu tier
        stages: list[_Stage] = []
        try:
            stages += [self._start_stage(plan, pinned) for plan in plans]  # every promotion starts now
            staged = [
                await self._finish_stage(plan, stage, pinned, sources)
                for plan, stage in zip(plans, stages, strict=True)
            ]
            windowed = [plan.pool.kind is AttentionKind.SLIDING_WINDOW for plan in plans]
            if any(windowed) and any(len(slots) != len(plan.keys) for plan, slots in zip(plans, staged, strict=True)):
                # A window is useless in part, and a window laid out for num_tokens is
                # wrong for a shorter prefix: a hybrid model loads all or nothing.
                return 0
            async with self._gate.hold(LOAD_PRIORITY):
                for plan, slots in zip(plans, staged, strict=True):
                    if not slots:
                        continue
                    pool = plan.pool
                    drivers = self._drivers[pool.id]
                    view = drivers.cpu.view
                    try:  # a view too: the cpu tier refuses them once closed
                        ops = [
                            TransferOp(buffer=view(slot), key=key, blocks=blocks, first_block=first)
                            for slot, key, blocks, first in zip(
                                slots, plan.keys, plan.blocks, plan.first_blocks, strict=False
                            )
                        ]
                        await drivers.gpus[rank].write(ops)
                    except TierError as exc:
                        self._transfer_failed("cpu->gpu", pool, request_id, exc)
                        return 0
                    block_bytes = pool.chunk_bytes // pool.blocks_per_chunk
                    self._telemetry.bytes_moved["cpu->gpu"] += block_bytes * sum(map(len, plan.blocks[: len(ops)]))
            good = [
                len(slots) * plan.pool.chunk_size
                for plan, slots, is_window in zip(plans, staged, windowed, strict=True)
                if not is_window
            ]
            return min([num_tokens, *good])
        finally:
            for plan, stage in zip(plans, stages, strict=False):
                for key, task in stage.promoted:
                    if task is not None:
                        self._drop_claim(plan, key, task)
            for pool, keys in pinned:
                pool.cpu.unpin_many(keys)

    def _start_stage(self, plan: _LoadPlan, pinned: list[tuple[Pool, list[ChunkKey]]]) -> _Stage:
        """The plan's leading chunks that some tier holds (the remote tier: likely): the
        leading run in cpu is pinned at once, and after it a shared promotion into cpu
        starts for each chunk another tier holds (one in cpu is pinned)."""
        pool = plan.pool
        namespace = plan.namespace
        hint = pool.hint
        in_cpu = pool.cpu.pin_ready_run(plan.keys, namespace)  # the usual case: all of them
        stage = _Stage(plan.keys[:in_cpu])
        pinned.append((pool, stage.in_cpu))
        for i in range(in_cpu, len(plan.keys)):
            key = plan.keys[i]
            if pool.cpu.ready_for(key, namespace):
                self._control.pin(pool, key)
                pinned.append((pool, [key]))
                stage.promoted.append((key, None))
            elif (pool.nvme is not None and pool.nvme.ready_for(key, namespace)) or (
                hint is not None and hint.likely(key, namespace)
            ):
                # Per namespace: a tenant's load never waits on, or is served by, a
                # promotion of another tenant's chunk under the same key.
                handle = (pool.fingerprint, pool.group, key, namespace)
                # The chunk before it in the plan is its predecessor (a window's first: not known).
                parent = plan.keys[i - 1] if i else None
                task = self._scheduler.shared(
                    handle,
                    functools.partial(self._promote, pool, key, plan.tenant, parent),
                    name=f"promote-{key.hex()[:8]}",
                )
                pool.claim(key, namespace)  # the promotion pins the chunk for each claim
                stage.promoted.append((key, task))
            else:
                break
        return stage

    async def _finish_stage(
        self,
        plan: _LoadPlan,
        stage: _Stage,
        pinned: list[tuple[Pool, list[ChunkKey]]],
        sources: dict[str, int],
    ) -> list[int]:
        """Wait for the promotions, which pin what they bring in for this load; the cpu
        slots of the leading chunks that are staged, in order. A promotion whose claim
        this settles is marked done in ``stage``."""
        pool = plan.pool
        run = stage.in_cpu
        slots: list[int] = []
        if run:  # pinned already: no await, one call each
            slots = pool.cpu.slots_of(run)
            self._telemetry.loaded["cpu"] += len(run)
            sources["cpu"] += len(run)
            selective = self._control.hits(pool, run)
            if selective:
                self._write_behind(pool, selective, plan.tenant)
        steps = stage.promoted
        for i, (key, task) in enumerate(steps):
            tier = "cpu"
            if task is not None:
                steps[i] = (key, None)
                try:
                    promoted = await self._promoted(task)
                except BaseException:
                    self._drop_claim(plan, key, task)
                    raise
                if promoted is None:
                    break
                pinned.append((pool, [key]))
                tier = promoted
            slots.append(pool.cpu.slot(key))
            self._telemetry.loaded[tier] += 1
            sources[tier] += 1
            if self._control.hit(pool, key):
                self._write_behind(pool, [key], plan.tenant)
        return slots

    def _drop_claim(self, plan: _LoadPlan, key: ChunkKey, task: asyncio.Task[str | None]) -> None:
        """Give up a load's claim on a promotion: its pin if the chunk came in, else its
        place among the claims the promotion will pin for."""
        pool = plan.pool
        if not task.done():
            pool.unclaim(key, plan.namespace)
        elif not task.cancelled() and task.exception() is None and task.result() is not None:
            self._control.unpin(pool, key)

    @staticmethod
    async def _promoted(task: asyncio.Task[str | None]) -> str | None:
        """Wait for a shared promotion without letting this caller's cancellation cancel
        it for the others; a promotion cancelled by someone else (close) is a miss."""
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and current is not None and not current.cancelling():
                return None
            raise

    async def _promote(self, pool: Pool, key: ChunkKey, tenant: Namespace, parent: ChunkKey | None) -> str | None:
        """Bring one chunk of ``tenant`` into cpu, from nvme or else the remote tier,
        shared by every load that claimed it. The tier it came from (``cpu`` when it was
        there already) once it is READY in cpu, pinned once for each claim, so that no
        eviction can take it between this task's end and its loads' next steps; ``None``
        when it could not come in."""
        namespace = tenant.fingerprint_hex
        source: str | None = None
        try:
            plan: Promotion | RemotePromotion | bool = self._control.plan_promotion(pool, key, namespace)
            if plan is False and pool.hint is not None:  # gone from nvme, or never there
                plan = self._control.plan_remote_promotion(pool, key, namespace, parent)
            if plan is True:
                source = "cpu"
            elif isinstance(plan, Promotion):
                source = "nvme" if await self._read_into_cpu(plan) else None
            elif isinstance(plan, RemotePromotion):
                source = "remote" if await self._read_remote_into_cpu(plan, tenant) else None
        finally:
            claims = pool.settle_claims(key, namespace)
        if source is not None:
            for _ in range(claims):
                self._control.pin(pool, key)
        if source == "remote" and pool.policy.write_policy is WritePolicy.WRITE_THROUGH:
            self._write_behind(pool, [key], tenant)  # local from now on: onto nvme too
        return source

    async def _read_into_cpu(self, promotion: Promotion) -> bool:
        pool = promotion.pool
        drivers = self._drivers[pool.id]
        assert drivers.nvme is not None
        outcome = PromotionOutcome.FAILED
        try:
            await self._spill(pool, promotion.evicted)
            op = TransferOp(buffer=drivers.cpu.view(promotion.cpu_slot), key=promotion.key, slot=promotion.nvme_slot)
            async with self._disk_gate.hold(LOAD_PRIORITY):
                await drivers.nvme.read([op])
            outcome = PromotionOutcome.DONE
        except TierError as exc:
            self._transfer_failed("nvme->cpu", pool, None, exc)
            if isinstance(exc, CorruptChunk):
                outcome = PromotionOutcome.CORRUPT
        finally:
            forget = self._control.complete_promotion(promotion, outcome)
            if forget:
                drivers.nvme.forget(forget)
        if outcome is PromotionOutcome.DONE:
            log.debug("chunk.promoted", namespace=pool.fingerprint, key=promotion.key.hex(), src="nvme", dst="cpu")
        return outcome is PromotionOutcome.DONE

    async def _read_remote_into_cpu(self, promotion: RemotePromotion, tenant: Namespace) -> bool:
        """Read one chunk the remote tier likely holds into its reserved cpu slot; false
        when the store has none (evicted, lost, corrupt: it deleted that one) or cannot
        be reached, which the control plane's hint then learns."""
        pool = promotion.pool
        drivers = self._drivers[pool.id]
        assert drivers.remote is not None
        ok = False
        try:
            await self._spill(pool, promotion.evicted)
            op = TransferOp(buffer=drivers.cpu.view(promotion.cpu_slot), key=promotion.key)
            async with self._remote_gate.hold(LOAD_PRIORITY):
                [ok] = await drivers.remote.read_each([op], namespace=tenant)
        except TierError as exc:
            self._transfer_failed("remote->cpu", pool, None, exc)
        finally:
            self._control.complete_remote_promotion(promotion, ok)
        key = promotion.key.hex()
        if ok:
            log.debug("chunk.promoted", namespace=pool.fingerprint, key=key, src="remote", dst="cpu")
        else:
            log.info("chunk.missed", namespace=pool.fingerprint, key=key, tier="remote", reason="not in the store")
        return ok

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
        keys, tables = self._store_arguments(namespace, request_id, keys, block_ids)
        bound = sum(len(k) for k in keys)
        await self._store_budget.take(bound)
        try:
            self._check()  # closed, or failed, while this store waited for room
            self._pools_of(namespace)  # still registered
        except BaseException:
            self._store_budget.give(bound)
            raise
        return self._submit_store(namespace, request_id, keys, tables, bound)

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
        keys, tables = self._store_arguments(namespace, request_id, keys, block_ids)
        bound = sum(len(k) for k in keys)
        self._store_budget.take_nowait(bound)
        return self._submit_store(namespace, request_id, keys, tables, bound)

    def _store_arguments(
        self, namespace: Namespace, request_id: str, keys: Sequence[Sequence[ChunkKey]], block_ids: object
    ) -> tuple[list[list[ChunkKey]], list[list[int]]]:
        """Check a store's arguments before it takes queue room: every key a chunk key,
        every block id an integer, the blocks of the chunks inside the rank's KV cache.
        Copies of the keys and of the block tables (as ints), which the store plans from:
        a caller that changes its lists while the store waits for room changes nothing."""
        pools = self._pools_of(namespace)
        require_request_id(request_id)
        copies = [list(group_keys) for group_keys in per_group(keys, len(pools), "keys", ChunkKeyError)]
        tables = [
            list(require_block_ids(table))
            for table in per_group(block_ids, len(pools), "block_ids", BlockTableError, arrays=True)
        ]
        for pool, group_keys, table in zip(pools, copies, tables, strict=True):
            require_keys(group_keys)
            # Blocks the engine no longer holds (negative ids) are not copied.
            num_blocks = self._drivers[pool.id].gpus[namespace.tp_rank].num_slots
            blocks_in_range(table, len(group_keys) * pool.blocks_per_chunk, num_blocks, holes=True)
        return copies, tables

    def _submit_store(
        self,
        namespace: Namespace,
        request_id: str,
        keys: Sequence[Sequence[ChunkKey]],
        block_ids: list[list[int]],
        taken: int,
    ) -> StoreResult:
        # Events of this store, in its background tasks too, carry the request and namespace.
        with bound_to_call(request_id=request_id, namespace=namespace.fingerprint_hex):
            try:
                plan = self._control.plan_store(namespace, keys, block_ids)
            except BaseException:
                self._store_budget.give(taken)
                raise
            if plan.rejected:
                log.info("store.skipped", request_id=request_id, reason="cannot store now")
                self._store_budget.give(taken)
                return StoreResult(submitted=0, skipped=plan.skipped, rejected=True)
            submitted = plan.submitted
            self._store_budget.give(taken - submitted)
            if plan.groups and plan.groups[0].pool.hint is not None:
                self._know_tenant(namespace)
            for group in plan.groups:
                job = _StoreJob(group, namespace, request_id)
                self._jobs[request_id].add(job)
                self._scheduler.start(
                    self._run_store(job), name=f"store-{request_id}", done=functools.partial(self._store_finished, job)
                )
            if submitted:
                log.debug("store.submitted", request_id=request_id, n_chunks=submitted)
            if plan.skipped:
                log.debug("store.skipped", request_id=request_id, n_chunks=plan.skipped)
            return StoreResult(submitted=submitted, skipped=plan.skipped)

    async def _run_store(self, job: _StoreJob) -> None:
        group = job.group
        pool = group.pool
        drivers = self._drivers[pool.id]
        started = self._clock()
        try:
            await self._spill(pool, group.evicted)
            ops = [
                TransferOp(buffer=drivers.cpu.view(group.slots[key]), key=key, blocks=blocks)
                for key, blocks in group.chunks
            ]
            async with self._gate.hold(STORE_PRIORITY):
                await drivers.gpus[job.rank].read(ops)
        except BaseException as exc:
            self._control.complete_store(group, ok=False)
            if not isinstance(exc, TierError):
                raise
            self._transfer_failed("gpu->cpu", pool, job.request_id, exc)
            return
        finally:
            # Done, failed or cancelled: no copy reads the engine's blocks any more.
            job.release_gpu()
        write_through = self._control.complete_store(group, ok=True)
        ms = (self._clock() - started) * 1e3
        log.debug(
            "store.done", namespace=pool.fingerprint, request_id=job.request_id, n_chunks=len(group.chunks), ms=ms
        )
        if write_through:
            self._write_behind(pool, write_through, job.namespace)

    def _store_finished(self, job: _StoreJob) -> None:
        """Whatever became of a store's copy, give back what its job holds. Its first step
        ran inside ``store`` (:meth:`Scheduler.start`), so ``_run_store``'s clean-up did too."""
        jobs = self._jobs[job.request_id]
        jobs.discard(job)
        if not jobs:
            del self._jobs[job.request_id]
        self._store_budget.give(len(job.group.chunks))

    # -- cpu → nvme, cpu → remote -------------------------------------------------------
    def _write_behind(self, pool: Pool, keys: list[ChunkKey], namespace: Namespace) -> None:
        """Copy ``namespace``'s READY cpu chunks to nvme and to the remote tier (each the
        pool has) in the background, as far as the bounded queues have room."""
        if self._closed:
            return
        if pool.hint is not None:
            self._write_remote(pool, keys, namespace)
        nvme = pool.nvme
        if nvme is None:
            return
        if nvme.any_resident(keys):  # usually none is: no Python step per key
            keys = [key for key in keys if key not in nvme]
        if not keys or not self._take_room(self._write_behind_budget, "nvme", pool, len(keys)):
            return
        # Started now: the copy pins its chunks before another store can evict them.
        self._scheduler.start(
            self._copy_to_nvme(pool, keys, namespace.fingerprint_hex),
            name="write-behind",
            done=lambda: self._write_behind_budget.give(len(keys)),
        )

    def _write_remote(self, pool: Pool, keys: list[ChunkKey], namespace: Namespace) -> None:
        assert pool.hint is not None
        fingerprint = namespace.fingerprint_hex
        keys = [key for key in keys if not pool.hint.likely(key, fingerprint)]
        if not keys or not self._take_room(self._remote_write_budget, "remote", pool, len(keys)):
            return
        self._scheduler.start(
            self._copy_to_remote(pool, keys, namespace),
            name="remote-write",
            done=lambda: self._remote_write_budget.give(len(keys)),
        )

    async def _copy_to_remote(self, pool: Pool, keys: list[ChunkKey], namespace: Namespace) -> None:
        """Write-through and selective: copy READY cpu chunks to the remote tier, pinned meanwhile."""
        write = self._control.plan_remote_copy(pool, keys, namespace.fingerprint_hex)
        if write is not None:
            await self._write_remote_chunks(write, namespace)

    async def _write_remote_chunks(self, write: RemoteWrite, namespace: Namespace) -> None:
        """Run one planned cpu → remote copy and report what landed. A failure — server
        gone, out of memory, timeout — drops the chunks there, never the cpu copies."""
        drivers = self._drivers[write.pool.id]
        assert drivers.remote is not None
        landed = [False] * len(write.chunks)
        try:  # a view too: the cpu tier refuses them once closed
            ops = [TransferOp(buffer=drivers.cpu.view(slot), key=key) for key, slot in write.chunks]
            async with self._remote_gate.hold(STORE_PRIORITY):
                landed = await drivers.remote.write_each(ops, namespace=namespace)
        except TierError as exc:
            self._transfer_failed("cpu->remote", write.pool, None, exc)
        finally:
            self._control.complete_remote_write(write, landed)
        if not all(landed):
            log.info(
                "store.skipped",
                tier="remote",
                namespace=write.pool.fingerprint,
                n_chunks=landed.count(False),
                reason="the store did not take them",
            )

    @staticmethod
    def _take_room(queue: Budget, tier: str, pool: Pool, n: int) -> bool:
        """Take room for ``n`` chunks in a bounded write queue; false (logged) when it is
        full: then they are simply not written to ``tier``."""
        try:
            queue.take_nowait(n)
        except TieredKVError:
            log.info("store.skipped", tier=tier, namespace=pool.fingerprint, n_chunks=n, reason="queue full")
            return False
        return True

    async def _copy_to_nvme(self, pool: Pool, keys: list[ChunkKey], namespace: str) -> None:
        """Write-through and selective: copy ``namespace``'s READY cpu chunks to nvme,
        pinned meanwhile. Planned (pinned) in the step that starts it; the copy itself is
        built and submitted in a turn of the loop of its own, not added to the step that
        marked the chunks READY."""
        write = self._control.plan_nvme_copy(pool, keys, namespace)
        if write is not None:
            await self._write_nvme(write, own_turn=True)

    async def _spill(self, pool: Pool, evicted: list[Victim]) -> None:
        """Write-back: copy chunks the cpu tier just evicted to nvme and to the remote tier
        (both at once) before their slots are reused."""
        if not evicted:
            return
        if pool.hint is None or pool.policy.write_policy is not WritePolicy.WRITE_BACK:
            await self._spill_to_nvme(pool, evicted)
            return
        # Each plans when it starts: one cancelled before its first step leaves no plan.
        spills = [
            asyncio.ensure_future(self._spill_to_nvme(pool, evicted)),
            asyncio.ensure_future(self._spill_to_remote(pool, evicted)),
        ]
        try:
            await asyncio.gather(*spills)
        finally:
            # Both read the victims' cpu slots, which this store's copy overwrites next:
            # neither is left running when the other fails or this store is cancelled.
            for spill in spills:
                spill.cancel()
            await wait_out(spills)

    async def _spill_to_nvme(self, pool: Pool, evicted: list[Victim]) -> None:
        write = self._control.plan_spill(pool, evicted)
        if write is not None:
            await self._write_nvme(write)

    async def _spill_to_remote(self, pool: Pool, evicted: list[Victim]) -> None:
        """One write per namespace, of the chunks whose namespace this manager still knows,
        as far as the remote write queue has room."""
        known = [victim for victim in evicted if victim.namespace in self._tenants]
        if not known or not self._take_room(self._remote_write_budget, "remote", pool, len(known)):
            return
        try:
            writes = [(w, self._tenants[w.namespace]) for w in self._control.plan_remote_spill(pool, known)]
            for write, tenant in writes:
                await self._write_remote_chunks(write, tenant)
        finally:
            self._remote_write_budget.give(len(known))

    async def _write_nvme(self, write: NvmeWrite, *, own_turn: bool = False) -> None:
        """Run one planned cpu → nvme copy and report it; failed or cancelled copies are
        dropped. ``own_turn``: first let the loop run what else is ready."""
        drivers = self._drivers[write.pool.id]
        assert drivers.nvme is not None
        ok = False
        try:
            if own_turn:
                await asyncio.sleep(0)
            tenants, view = write.tenants, drivers.cpu.view
            ops = [
                TransferOp(buffer=view(cpu_slot), key=key, slot=nvme_slot, restorable=key not in tenants)
                for key, cpu_slot, nvme_slot in write.chunks
            ]
            async with self._disk_gate.hold(STORE_PRIORITY):
                await drivers.nvme.write(ops)
            ok = True
        except TierError as exc:
            self._transfer_failed("cpu->nvme", write.pool, None, exc)
        finally:
            forget = self._control.complete_nvme_write(write, ok)
            if forget:
                drivers.nvme.forget(forget)

    # -- remote tier: tenants and probes -------------------------------------------------
    def _know_tenant(self, namespace: Namespace) -> None:
        tenants = self._tenants
        fingerprint = namespace.fingerprint_hex
        if fingerprint in tenants:
            tenants.move_to_end(fingerprint)
            return
        tenants[fingerprint] = namespace
        if len(tenants) > self._max_known_tenants:
            tenants.popitem(last=False)

    def _start_probes(self, pool: Pool) -> None:
        self._probing.add(pool.id)
        try:
            self._scheduler.spawn(self._probe(pool), name="remote-probe")
        except BaseException:
            self._probing.discard(pool.id)
            raise

    async def _probe(self, pool: Pool) -> None:
        """Ask the remote tier about the keys lookups queued, one batched ``EXISTS`` per
        namespace at a time, until none is left; the hint learns each answer (a node that
        cannot be asked answers "absent" until its entries expire)."""
        hint, remote, config = pool.hint, self._drivers[pool.id].remote, self.config.remote
        assert hint is not None and remote is not None and config is not None
        try:
            while probes := hint.take_probes(config.probe_batch):
                by_namespace: dict[str, list[ChunkKey]] = {}
                for key, namespace in probes:
                    by_namespace.setdefault(namespace, []).append(key)
                for namespace, keys in by_namespace.items():
                    tenant = self._tenants.get(namespace)
                    if tenant is None:
                        continue
                    async with self._remote_gate.hold(LOAD_PRIORITY):
                        found = await remote.exists(keys, namespace=tenant)
                    hint.note_present([key for key, yes in zip(keys, found, strict=True) if yes], namespace)
                    hint.note_absent([key for key, yes in zip(keys, found, strict=True) if not yes], namespace)
        except TierError as exc:
            self._transfer_failed("probe", pool, None, exc)
        finally:
            self._probing.discard(pool.id)

    # -- request lifecycle -------------------------------------------------------------
    async def finish_request(self, request_id: str) -> None:
        """Return once no store of ``request_id`` still reads the request's GPU blocks."""
        self._check()
        require_request_id(request_id)
        await self._released(self._jobs.get(request_id, ()))

    def finish_request_nowait(self, request_id: str) -> bool:
        """True when the request's GPU blocks may be freed now (no store reads them)."""
        self._check()
        return all(job.released for job in self._jobs.get(require_request_id(request_id), ()))

    def flush_nowait(self, block_ids: Iterable[int] | None = None, *, namespace: Namespace | None = None) -> bool:
        """True when no store reads any of ``block_ids`` (see :meth:`flush`) now."""
        self._check()
        return not self._reading(block_ids, namespace)

    async def flush(self, block_ids: Iterable[int] | None = None, *, namespace: Namespace | None = None) -> None:
        """Return once no store reads any of ``block_ids`` (all blocks when ``None``) of
        ``namespace``'s rank (every registered rank when ``None``)."""
        self._check()
        await self._released(self._reading(block_ids, namespace))

    def _reading(self, block_ids: Iterable[int] | None, namespace: Namespace | None) -> list[_StoreJob]:
        """The store jobs still reading any of ``block_ids`` of ``namespace``'s rank."""
        if namespace is not None:
            require_namespace(namespace)
        wanted = None if block_ids is None else frozenset(require_flushed_blocks(block_ids))
        rank = None if namespace is None else (namespace.base.fingerprint_hex, namespace.tp_rank)
        return [
            job
            for jobs in self._jobs.values()
            for job in jobs
            if not job.released
            and (rank is None or (job.group.pool.fingerprint, job.rank) == rank)
            and (wanted is None or not wanted.isdisjoint(job.blocks))
        ]

    async def _released(self, jobs: Iterable[_StoreJob]) -> None:
        """Wait for ``jobs`` to stop reading GPU blocks (a future only for those still
        reading); the caller's cancellation does not cancel the stores."""
        waiting = [job.gpu_released for job in jobs if not job.released]
        if len(waiting) == 1:
            await asyncio.shield(waiting[0])
        elif waiting:
            await asyncio.shield(asyncio.gather(*waiting))
        self._check()

    async def drain(self) -> None:
        """Return once every background copy (stores, write-behind, remote writes and
        probes, promotions) is done and every chunk stored so far on nvme is durable."""
        self._check()
        await self._scheduler.drain()
        for drivers in list(self._drivers.values()):
            if drivers.nvme is not None:
                await drivers.nvme.sync()
        self._check()

    # -- observation -------------------------------------------------------------------
    def statistics(self) -> Statistics:
        """The tiers' usage, queue depths, drivers' and remote pools' figures, and the
        telemetry's counters; once closed, those at its close."""
        if self._closed_statistics is not None:
            return self._closed_statistics
        tiers, namespaces = self._control.usage()
        queue_depths = {
            "stores": self._store_budget.used,
            "write_behind": self._write_behind_budget.used,
            "loads": self._loads_in_flight,
            "copies_waiting": self._gate.waiting,
            "nvme_io_waiting": self._disk_gate.waiting,
            "background_tasks": self._scheduler.background,
            "promotion_claims": sum(pool.claims_held() for pool in self._control.pools.values()),
        }
        remote = []
        for pool in self._control.pools.values():
            driver = self._drivers[pool.id].remote if pool.id in self._drivers else None
            if pool.hint is not None and driver is not None:
                remote.append(
                    RemotePoolStatistics(
                        namespace=pool.fingerprint,
                        model_id=pool.model_id,
                        group=pool.group,
                        driver=driver.remote_statistics(),
                        hint=pool.hint.statistics(),
                    )
                )
        if self.config.remote is not None:
            queue_depths["remote_writes"] = self._remote_write_budget.used
            queue_depths["remote_io_waiting"] = self._remote_gate.waiting
        return self._telemetry.statistics(
            tiers=tiers,
            namespaces=namespaces,
            queue_depths=queue_depths,
            drivers=[driver.statistics() for driver in self._all_drivers()],
            remote=remote,
        )

    def _all_drivers(self) -> list[TierDriver]:
        drivers: list[TierDriver] = []
        for pool in self._drivers.values():
            drivers += [*pool.gpus.values(), *pool.stores()]
        return list(dict.fromkeys(drivers))

    def drain_events(self, max_events: int | None = None) -> list[KVEvent]:
        """Take up to ``max_events`` KV events (all when ``None``), oldest first. The
        records are built as they are drained: a bounded ``max_events`` per call bounds
        how long the call holds the loop."""
        return self._telemetry.drain_events(max_events)

    def check_invariants(self) -> None:
        """Raise if any residency index contradicts itself (for tests and debugging); a
        closed manager holds none."""
        self._control.verify_invariants()

    # -- helpers -----------------------------------------------------------------------
    def _transfer_failed(self, path: str, pool: Pool, request_id: str | None, exc: TierError) -> None:
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
    """The default :class:`TierFactory`: the drivers registered as ``gpu``, ``cpu``, ``nvme``, ``remote``."""

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

    async def remote(
        self, namespace: Namespace, group: int, slot_bytes: int, num_slots: int, config: RemoteTierConfig
    ) -> RemoteTier:
        opener = TIERS.get("remote").open  # type: ignore[attr-defined]
        driver: RemoteTier = await opener(config, namespace, slot_bytes=slot_bytes, num_slots=num_slots, group=group)
        return driver

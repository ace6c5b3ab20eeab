"""The control plane: which chunk lives where, and which copies to make.

Synchronous and free of I/O. It owns every pool's residency index per tier, the tenants'
shares of them and the admission filters, and answers with *plans* — slots reserved,
victims chosen, copies to make — that a data plane carries out with the tier drivers and
reports back through ``complete_*``. Between a plan and its completion the slots it names
are PENDING or pinned, so the indexes are consistent whatever runs meanwhile, and a plan
the data plane gives up on is undone by completing it as failed.

:class:`~tiered_kv.manager.TieredKV` runs it beside its asyncio data plane in one
process; an engine that splits scheduler and workers (vLLM) runs it in the scheduler's
process and sends the plans' slots to the workers (``docs/vllm.md``).

A *pool* is one model runner's KV group: a base namespace (without tenant fields) × group
index, with a cpu index and optionally an nvme index of equal-sized chunk slots. Its
tenants (LoRA adapters, cache salts) share it through the indexes' partitions, each with
a policy and a quota of its own; a chunk is served only to the namespace that stored it.

Below nvme a pool may have a remote tier: a store shared with other engines that evicts
as it pleases, so the control plane keeps no index of it, only a
:class:`~tiered_kv.remote_hint.ResidencyHint` of what it likely holds. ``lookup`` counts
a likely-remote chunk as a hit; the promise is "likely": the load may find it gone, and
then returns the good prefix before it.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from tiered_kv._blockids import scan
from tiered_kv._keytable import KeyInts
from tiered_kv.arguments import distinct_blocks, require_namespace
from tiered_kv.config import NamespacePolicyConfig, RemoteTierConfig, WritePolicy
from tiered_kv.directory import PENDING, READY, LeaseEpoch, Reservation, TierIndex, Victim
from tiered_kv.errors import ChunkKeyError, ConfigError, NamespaceError
from tiered_kv.interfaces import AdmissionFilter
from tiered_kv.keys import ChunkKey
from tiered_kv.layout import AttentionKind
from tiered_kv.log import get_logger
from tiered_kv.namespace import Namespace
from tiered_kv.partition import TierPartition
from tiered_kv.policy_factory import make_admission_filter
from tiered_kv.remote_hint import ResidencyHint
from tiered_kv.spans import span_chunks, window_span
from tiered_kv.stats import KVEventKind, NamespaceUsage, TierUsage
from tiered_kv.telemetry import Telemetry

log = get_logger("control")

#: Chunks of a warm restart recorded in one :meth:`ControlPlane.restore` call, between which
#: its caller returns to its event loop (or, under vLLM, its scheduler thread): about
#: 0.6 ms at a million chunks, where batches of 4,096 held the loop up to 6 ms.
RESTORE_BATCH = 1024


class ChunkState(enum.Enum):
    """Where a namespace's chunk can be read from now."""

    ABSENT = "absent"
    #: Bytes are moving into a cpu slot (a store or a promotion): not readable yet.
    CPU_PENDING = "cpu_pending"
    CPU_READY = "cpu_ready"
    #: Only nvme holds it: a promotion into cpu must come first.
    NVME_READY = "nvme_ready"
    #: No local tier holds it, and the remote tier likely does: a promotion may bring it in.
    REMOTE_LIKELY = "remote_likely"


class Pool:
    """One model runner's KV group in the control plane: its indexes and tenants."""

    def __init__(
        self,
        base: Namespace,
        group: int,
        policy: NamespacePolicyConfig,
        cpu: TierIndex,
        nvme: TierIndex | None,
        admission: AdmissionFilter | None,
        hint: ResidencyHint | None = None,
    ) -> None:
        geometry = base.geometry
        self.fingerprint = base.fingerprint_hex
        self.model_id = base.model_id
        self.group = group
        self.id = (self.fingerprint, group)
        self.kind = geometry.groups[group].kind
        self.window = geometry.groups[group].window
        self.block_size = geometry.block_size
        self.chunk_size = geometry.chunk_size
        self.blocks_per_chunk = geometry.blocks_per_chunk
        self.chunk_bytes = geometry.chunk_bytes(group)
        self.policy = policy
        self.cpu = cpu
        self.nvme = nvme
        #: Turns away chunks not yet seen often enough to be worth storing (``None``: none).
        self.admission = admission
        #: What the remote tier likely holds (``None``: the pool has no remote tier).
        self.hint = hint
        #: Tenant namespaces (fingerprints) that have a share in this pool's partitions.
        self.owners: set[str] = set()
        #: Loads waiting on each promotion into cpu: key → namespace → claims. While a
        #: key has claims, writes to nvme do not evict it for room (a load would come back
        #: without a chunk its lookup counted).
        self.claims: dict[ChunkKey, collections.Counter[str]] = {}

    def claim(self, key: ChunkKey, namespace: str) -> None:
        """A load waits on the promotion of ``namespace``'s ``key``."""
        self.claims.setdefault(key, collections.Counter())[namespace] += 1

    def unclaim(self, key: ChunkKey, namespace: str) -> None:
        """A load gave up its claim before the promotion settled."""
        self.settle_claims(key, namespace, 1)

    def settle_claims(self, key: ChunkKey, namespace: str, most: int | None = None) -> int:
        """Take ``most`` (all, when ``None``) of the claims on the promotion of
        ``namespace``'s ``key``; how many there were to take."""
        by_namespace = self.claims.get(key)
        if by_namespace is None:
            return 0
        held = by_namespace[namespace]
        taken = held if most is None else min(most, held)
        if held - taken > 0:
            by_namespace[namespace] = held - taken
        else:
            del by_namespace[namespace]
            if not by_namespace:
                del self.claims[key]
        return taken

    def claims_held(self) -> int:
        """Claims on promotions, over every key and namespace."""
        return sum(sum(by_namespace.values()) for by_namespace in self.claims.values())

    def indexes(self) -> list[TierIndex]:
        return [self.cpu] if self.nvme is None else [self.cpu, self.nvme]

    def state(self, key: ChunkKey, namespace: str) -> ChunkState:
        """Where ``namespace`` can read ``key`` from now."""
        in_cpu = self.cpu.state_for(key, namespace)
        if in_cpu == READY:
            return ChunkState.CPU_READY
        if in_cpu == PENDING:
            return ChunkState.CPU_PENDING
        if self.nvme is not None and self.nvme.ready_for(key, namespace):
            return ChunkState.NVME_READY
        if self.hint is not None and self.hint.likely(key, namespace):
            return ChunkState.REMOTE_LIKELY
        return ChunkState.ABSENT

    def ready_prefix(self, keys: Sequence[ChunkKey], namespace: str, n: int) -> tuple[int, int, int]:
        """How many of ``keys[:n]`` are ready for ``namespace`` in some tier (the remote
        tier: likely), from the first, how many of those only nvme holds and how many only
        the remote tier (the lookup hot path). A key no tier holds ends the run; it and the
        unknown keys after it are queued for a remote probe."""
        start = self.cpu.ready_run(keys, namespace, 0, n)
        if start == n or (self.nvme is None and self.hint is None):
            return start, 0, 0  # all in cpu (a hot prefix), or no other tier to look in
        in_cpu = self.cpu.ready_for
        in_nvme = self.nvme.ready_for if self.nvme is not None else None
        hint = self.hint
        from_nvme = from_remote = 0
        for i in range(start, n):
            key = keys[i]
            if in_cpu(key, namespace):
                continue
            if in_nvme is not None and in_nvme(key, namespace):
                from_nvme += 1
                continue
            if hint is None:
                return i, from_nvme, from_remote
            if not hint.likely(key, namespace):
                hint.probe_from(keys, i, namespace)
                return i, from_nvme, from_remote
            from_remote += 1
        return n, from_nvme, from_remote

    def source(self, key: ChunkKey, namespace: str) -> str | None:
        """The fastest tier ``namespace`` can read ``key`` from (the remote tier: likely), or ``None``."""
        if self.cpu.ready_for(key, namespace):
            return "cpu"
        if self.nvme is not None and self.nvme.ready_for(key, namespace):
            return "nvme"
        if self.hint is not None and self.hint.likely(key, namespace):
            return "remote"
        return None

    def resident_anywhere(self, key: ChunkKey) -> bool:
        return key in self.cpu or (self.nvme is not None and key in self.nvme)

    def any_resident(self, keys: Sequence[ChunkKey]) -> bool:
        """Whether a tier holds any of ``keys`` (at C speed: a store's usual answer is no)."""
        return self.cpu.any_resident(keys) or (self.nvme is not None and self.nvme.any_resident(keys))


@dataclasses.dataclass(slots=True)
class StoreGroup:
    """One KV group's part of a store: chunks to copy out of GPU blocks into cpu slots."""

    pool: Pool
    #: The fingerprint of the namespace storing.
    namespace: str
    #: ``(key, GPU block ids)`` in prefix order.
    chunks: list[tuple[ChunkKey, tuple[int, ...]]]
    #: The cpu slot reserved (PENDING) for each key.
    slots: dict[ChunkKey, int]
    #: Chunks evicted from cpu to make room; under write-back their bytes are still in
    #: ``slots`` until they are spilled, which must happen before the copy.
    evicted: list[Victim]


@dataclasses.dataclass(slots=True)
class StorePlan:
    groups: list[StoreGroup]
    #: Chunks not stored: already resident, touching a block the engine no longer holds,
    #: turned away by the admission filter, or (``partial``) beyond what fits.
    skipped: int
    #: Nothing fits now (every victim pinned or pending): nothing was reserved.
    rejected: bool = False

    @property
    def submitted(self) -> int:
        return sum(len(group.chunks) for group in self.groups)


@dataclasses.dataclass(slots=True)
class Promotion:
    """Read ``key`` from nvme slot ``nvme_slot`` (pinned) into cpu slot ``cpu_slot`` (PENDING)."""

    pool: Pool
    key: ChunkKey
    namespace: str
    cpu_slot: int
    nvme_slot: int
    #: Chunks the cpu reservation evicted (to spill first under write-back).
    evicted: list[Victim]


@dataclasses.dataclass(slots=True)
class NvmeWrite:
    """Copy chunks from cpu slots into nvme slots reserved for them (PENDING)."""

    pool: Pool
    #: ``(key, cpu slot, nvme slot)``.
    chunks: list[tuple[ChunkKey, int, int]]
    #: cpu chunks pinned while their bytes are written (released on completion).
    pinned: list[ChunkKey]
    #: Those of ``chunks`` that are tenants' (a namespace other than the pool's model): a
    #: warm restart knows no tenants, so the store must not bring them back.
    tenants: set[ChunkKey] = dataclasses.field(default_factory=set)


@dataclasses.dataclass(slots=True)
class RemotePromotion:
    """Read ``namespace``'s ``key`` from the remote tier into cpu slot ``cpu_slot`` (PENDING)."""

    pool: Pool
    key: ChunkKey
    namespace: str
    cpu_slot: int
    #: Chunks the cpu reservation evicted (to spill first under write-back).
    evicted: list[Victim]


@dataclasses.dataclass(slots=True)
class RemoteWrite:
    """Copy chunks of one namespace from cpu slots to the remote tier."""

    pool: Pool
    #: The namespace the chunks belong to (their names and headers bind it).
    namespace: str
    #: ``(key, cpu slot)``.
    chunks: list[tuple[ChunkKey, int]]
    #: cpu chunks pinned while their bytes are written (released on completion); a
    #: write-back spill pins none: its slots are the new chunks' PENDING reservation.
    pinned: list[ChunkKey]


class PromotionOutcome(enum.Enum):
    DONE = "done"
    #: The read failed or was cancelled: the nvme copy may still be good.
    FAILED = "failed"
    #: The bytes failed verification: the nvme copy is dropped.
    CORRUPT = "corrupt"


class ControlPlane:
    """Residency, tenants and plans of every pool of one manager."""

    def __init__(
        self,
        telemetry: Telemetry,
        *,
        max_tenants: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.telemetry = telemetry
        self.pools: dict[tuple[str, int], Pool] = {}
        self._by_base: dict[str, list[Pool]] = {}
        self._max_tenants = max_tenants
        self._clock = clock
        self._epoch = LeaseEpoch()

    # -- pools -------------------------------------------------------------------------
    def add_pools(
        self,
        base: Namespace,
        policy: NamespacePolicyConfig,
        cpu_slots: int,
        nvme_slots: int,
        remote: RemoteTierConfig | None = None,
    ) -> list[Pool]:
        """One pool per KV group of ``base``, each with ``cpu_slots`` (and ``nvme_slots``),
        and a residency hint of the ``remote`` tier if there is one."""
        if base.fingerprint_hex in self._by_base:
            raise ConfigError(f"{base.model_id} already has pools", field="namespace")
        pools = []
        for group in range(len(base.geometry.groups)):
            cpu = TierIndex("cpu", TierPartition("cpu", cpu_slots, clock=self._clock), self._epoch)
            nvme = None
            if nvme_slots:
                # Leases and hit counts serve the cpu tier (loads pin there; selective writes).
                nvme = TierIndex("nvme", TierPartition("nvme", nvme_slots, clock=self._clock), count_hits=False)
            admission = None
            if policy.admission is not None:
                # It remembers a few times more chunks than the tiers hold: a chunk worth
                # storing comes back before that many others have been seen.
                remembered = 4 * (cpu_slots + nvme_slots)
                admission = make_admission_filter(policy.admission, remembered, k=policy.admission_k)
            hint = None
            if remote is not None:
                hint = ResidencyHint(
                    remote.hint_chunks,
                    probe_capacity=remote.max_probes,
                    probe_ahead=remote.probe_ahead,
                    absent_ttl_s=remote.absent_ttl_s,
                    clock=self._clock,
                )
            pools.append(Pool(base, group, policy, cpu, nvme, admission, hint))
        for pool in pools:
            self.owner(pool, pool.fingerprint)  # the model's own share comes first
            self.pools[pool.id] = pool
        self._by_base[base.fingerprint_hex] = pools
        return pools

    def remove_pools(self, base: Namespace) -> None:
        """Forget the pools of ``base`` (a registration that failed after adding them)."""
        for pool in self._by_base.pop(base.fingerprint_hex, []):
            del self.pools[pool.id]

    def close_pools(self) -> Iterator[None]:
        """Forget every pool, letting go of their indexes' records and policies' keys a
        step at a time (yielding between steps): a closed manager's."""
        pools = list(self.pools.values())
        self.pools.clear()
        self._by_base.clear()
        for pool in pools:
            for index in pool.indexes():
                yield from index.clear_in_steps()

    def begin_restore(self, pool: Pool, chunks: KeyInts | None = None) -> None:
        """Start a warm restart of what a reopened nvme store holds: :meth:`restore` each
        batch, then :meth:`restored`. ``chunks`` (key → slot of all of it) is taken over
        as the pool's index, and the batches are its items; without it, each batch adds
        its own (see :meth:`TierIndex.begin_restore`)."""
        assert pool.nvme is not None
        pool.nvme.begin_restore(chunks, pool.fingerprint)

    def restore(self, pool: Pool, keys: Sequence[ChunkKey], slots: Sequence[int]) -> None:
        """Record a batch of the chunks :meth:`begin_restore` named. A warm restart cannot
        tell which tenant stored a chunk: they belong to the model's own namespace."""
        assert pool.nvme is not None
        pool.nvme.restore_many(keys, slots, pool.fingerprint)

    def restored(self, pool: Pool) -> None:
        """The last batch of :meth:`restore` is in: the pool is ready for use."""
        for _ in self.settling(pool):
            pass

    def settling(self, pool: Pool) -> Iterator[None]:
        """:meth:`restored` in steps, yielding between them: an asyncio caller gives the
        event loop back at each (the pool is ready after the last)."""
        assert pool.nvme is not None
        return pool.nvme.settling()

    def pools_of(self, namespace: Namespace) -> list[Pool]:
        """The pools of ``namespace``'s model runner, one per KV group."""
        pools = self._by_base.get(require_namespace(namespace).base_fingerprint_hex)
        if pools is None:
            raise NamespaceError(f"namespace {namespace.model_id} is not registered")
        return pools

    def owner(self, pool: Pool, namespace: str) -> str:
        """The share in the pool's partitions that chunks of ``namespace`` (a fingerprint)
        count in: its own, added on its first use with the
        policy and quotas of its model's config. A quota that no longer fits beside the
        others' is dropped (logged as ``quota.unavailable``): the tenant shares the rest.

        Shares are bounded (``max_tenants`` per pool): past the bound, tenants holding no
        chunk lose their share, and if none does, the newcomer's chunks count in one
        overflow share without a quota (logged as ``tenant.limit``); they stay the
        newcomer's to read.
        """
        owner = namespace
        if owner in pool.owners:
            return owner
        indexes = pool.indexes()
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
                return self._overflow(pool)
        for index in indexes:
            quota = pool.policy.quota_chunks.get(index.tier, 0)
            try:
                index.partition.add_namespace(owner, pool.policy.policy, quota=quota)
            except ConfigError as exc:
                log.warning("quota.unavailable", namespace=owner, tier=index.tier, quota=quota, error=str(exc))
                index.partition.add_namespace(owner, pool.policy.policy)
        pool.owners.add(owner)
        return owner

    def _overflow(self, pool: Pool) -> str:
        """The share of the tenants past ``max_tenants``: a quota of none, so that their
        traffic never takes the chunks another share holds under its quota (the model's
        own among them)."""
        overflow = f"{pool.fingerprint}:overflow"
        for index in pool.indexes():
            if overflow not in index.partition.namespaces():
                index.partition.add_namespace(overflow, pool.policy.policy)
        return overflow

    # -- lookup ------------------------------------------------------------------------
    def lookup(self, namespace: Namespace, keys: Sequence[Sequence[ChunkKey]], pools: list[Pool] | None = None) -> int:
        """How many leading chunks ``namespace`` can load now: every full-attention (and
        MLA) group holds chunks ``0 … n−1`` ready and every sliding-window group holds the
        chunks its window at ``n`` chunks overlaps. The caller checked ``keys``' shape
        (and may pass the namespace's ``pools`` it looked up already)."""
        if pools is None:
            pools = self.pools_of(namespace)
        owner = namespace.fingerprint_hex
        try:
            if len(pools) == 1 and pools[0].kind is not AttentionKind.SLIDING_WINDOW:
                asked = len(keys[0])
                n, from_nvme, from_remote = pools[0].ready_prefix(keys[0], owner, asked)
            else:
                asked, n, from_nvme, from_remote = self._lookup_groups(pools, keys, owner)
        except TypeError as exc:  # an unhashable "key"
            raise ChunkKeyError(f"a chunk key must be bytes: {exc}") from None
        telemetry = self.telemetry
        telemetry.hit_cpu += n - from_nvme - from_remote
        telemetry.missed += asked - n
        if from_nvme or from_remote:
            telemetry.hit_nvme += from_nvme
            telemetry.hit_remote += from_remote
        return n

    def _lookup_groups(
        self, pools: list[Pool], keys: Sequence[Sequence[ChunkKey]], owner: str
    ) -> tuple[int, int, int, int]:
        """:meth:`lookup` over several KV groups: chunk positions asked, found, and of
        those how many some full-attention group needs from nvme and how many from the
        remote tier (the slowest tier a position needs counts)."""
        asked = n = min(len(group_keys) for group_keys in keys)
        windowed = []
        full = []
        for pool, group_keys in zip(pools, keys, strict=True):
            if pool.kind is AttentionKind.SLIDING_WINDOW:
                windowed.append((pool, group_keys))
                continue
            n, _, _ = pool.ready_prefix(group_keys, owner, n)
            full.append((pool, group_keys))
        for pool, group_keys in windowed:
            if pool.hint is not None:
                # The window at the whole prompt (where probes of the full groups may
                # take the prefix) and the window at the prefix found now.
                for at in {asked, n} - {0}:
                    self._probe_window(pool, group_keys, at, owner)
        while n and not all(self._window_ready(pool, group_keys, n, owner) for pool, group_keys in windowed):
            n -= 1
        slowest = ["cpu"] * n
        for pool, group_keys in full:
            if pool.nvme is not None or pool.hint is not None:
                for i in range(n):
                    source = pool.source(group_keys[i], owner)
                    if source == "remote" or (source == "nvme" and slowest[i] == "cpu"):
                        slowest[i] = source
        return asked, n, slowest.count("nvme"), slowest.count("remote")

    @staticmethod
    def _window_chunks(pool: Pool, n_chunks: int) -> range:
        assert pool.window is not None
        span = window_span(n_chunks * pool.chunk_size, pool.window, pool.block_size)
        return span_chunks(span, block_size=pool.block_size, chunk_size=pool.chunk_size).chunks

    def _window_ready(self, pool: Pool, keys: Sequence[ChunkKey], n_chunks: int, owner: str) -> bool:
        return all(pool.source(keys[c], owner) is not None for c in self._window_chunks(pool, n_chunks))

    def _probe_window(self, pool: Pool, keys: Sequence[ChunkKey], n_chunks: int, owner: str) -> None:
        """Queue remote probes for the chunks of the window at ``n_chunks`` that no tier knows of."""
        assert pool.hint is not None
        for c in self._window_chunks(pool, n_chunks):
            if pool.source(keys[c], owner) is None:
                pool.hint.probe_from(keys, c, owner)
                return

    # -- leases ------------------------------------------------------------------------
    def lease(self, pool: Pool, key: ChunkKey) -> None:
        """Keep a READY cpu chunk from eviction until :meth:`end_step` (an engine that
        answers a lookup in one call and plans the load in a later one of the same step)."""
        pool.cpu.lease(key)

    def end_step(self) -> None:
        """Every lease taken so far expires, at once."""
        self._epoch.advance()

    def pin(self, pool: Pool, key: ChunkKey) -> int:
        """Pin a READY cpu chunk for a load; its slot. Undo with :meth:`unpin`."""
        return pool.cpu.pin(key)

    def unpin(self, pool: Pool, key: ChunkKey) -> None:
        pool.cpu.unpin(key)

    def hits(self, pool: Pool, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """:meth:`hit` on each of ``keys``: those the selective write policy now wants on nvme."""
        counts = pool.cpu.hit_many(keys)
        if pool.policy.write_policy is not WritePolicy.SELECTIVE:
            return []
        wanted = pool.policy.selective_hits
        return [key for key, count in zip(keys, counts, strict=True) if count >= wanted]

    def hit(self, pool: Pool, key: ChunkKey) -> bool:
        """Count a load's hit on a cpu chunk; True when the selective write policy now
        wants it on nvme."""
        hits = pool.cpu.hit(key)
        return pool.policy.write_policy is WritePolicy.SELECTIVE and hits >= pool.policy.selective_hits

    # -- stores ------------------------------------------------------------------------
    def plan_store(
        self,
        namespace: Namespace,
        keys: Sequence[Sequence[ChunkKey]],
        block_ids: Sequence[Sequence[int]],
        *,
        partial: bool = False,
    ) -> StorePlan:
        """Reserve cpu slots (PENDING) for the full chunks of ``keys`` that no tier holds.

        ``block_ids[g]`` is group ``g``'s block table from the prompt's first block; a
        negative id marks a block the engine no longer holds, and chunks touching one are
        skipped. All or nothing over the groups, unless ``partial``: then each group
        stores the longest prefix of its chunks that fits. The caller checked the
        arguments' shape and types (:mod:`tiered_kv.arguments`).
        """
        pools = self.pools_of(namespace)
        fingerprint = namespace.fingerprint_hex
        planned: list[tuple[Pool, list[tuple[ChunkKey, tuple[int, ...]]]]] = []
        #: Each chunk's predecessor: the previous position's key (stored or skipped).
        parents: dict[ChunkKey, ChunkKey | None] = {}
        skipped = 0
        for pool, group_keys, table in zip(pools, keys, block_ids, strict=True):
            k = pool.blocks_per_chunk
            resident = pool.resident_anywhere
            whole = min(len(group_keys), len(table) // k)  # chunks the table names every block of
            skipped += len(group_keys) - whole
            chunk_keys = group_keys[:whole]
            # Each key with its k blocks (k copies of one iterator, zipped, take k ids a time).
            candidates = list(zip(chunk_keys, zip(*[iter(table[: whole * k])] * k, strict=True), strict=True))
            lowest, _, distinct = scan(table, whole * k, True) or (-1, -1, False)
            if lowest >= 0 and len(set(chunk_keys)) == whole and not pool.any_resident(chunk_keys):
                # The usual store: every chunk new, named once, over blocks the engine holds.
                parents.update(zip(chunk_keys, [None, *chunk_keys], strict=False))  # each the one before it
                if not distinct:
                    distinct_blocks(table, whole * k, "to be stored")
            else:  # chunk by chunk: those touching a dropped block, repeated or held are skipped
                every, candidates, seen = candidates, [], set()
                for c, (key, blocks) in enumerate(every):
                    if min(blocks) < 0 or key in seen or resident(key):
                        skipped += 1
                        continue
                    seen.add(key)
                    parents[key] = chunk_keys[c - 1] if c else None
                    candidates.append((key, blocks))
                held = [block for _, blocks in candidates for block in blocks]
                distinct_blocks(held, len(held), "to be stored")
            planned.append((pool, candidates))
        return self._reserve_store(planned, parents, fingerprint, skipped, partial)

    def _reserve_store(
        self,
        planned: list[tuple[Pool, list[tuple[ChunkKey, tuple[int, ...]]]]],
        parents: dict[ChunkKey, ChunkKey | None],
        fingerprint: str,
        skipped: int,
        partial: bool,
    ) -> StorePlan:
        groups: list[StoreGroup] = []
        try:
            for pool, candidates in planned:
                group = self._reserve_group(pool, candidates, parents, fingerprint, partial)
                if group is None:
                    # Nothing has been copied yet: undo the other groups' reservations, their
                    # victims included, so that a rejected store changes nothing.
                    self._unreserve(groups)
                    self.telemetry.stores_rejected += 1
                    log.info("tier.full", tier="cpu", namespace=pool.fingerprint, n_chunks=len(candidates))
                    return StorePlan(groups=[], skipped=skipped, rejected=True)
                if group.chunks:
                    groups.append(group)
                skipped += len(candidates) - len(group.chunks)
        except BaseException:
            self._unreserve(groups)
            raise
        for group in groups:  # only now: a rejected plan puts its victims back
            self._evicted(group.pool, "cpu", group.evicted)
        return StorePlan(groups=groups, skipped=skipped)

    @staticmethod
    def _unreserve(groups: list[StoreGroup]) -> None:
        for group in groups:
            group.pool.cpu.unreserve(Reservation(group.slots, group.evicted))

    def _reserve_group(
        self,
        pool: Pool,
        candidates: list[tuple[ChunkKey, tuple[int, ...]]],
        parents: dict[ChunkKey, ChunkKey | None],
        fingerprint: str,
        partial: bool,
    ) -> StoreGroup | None:
        """One group's reservation of the chunks its admission filter lets through (all of
        them, or with ``partial`` the longest prefix that fits); ``None`` when nothing fits."""
        chunks = candidates
        if pool.admission is not None:
            # Every chunk is a sighting; after one the filter turns away, the rest of the
            # prefix would be unreachable, so none of it is stored.
            admitted = [pool.admission.admit(key, parents[key]) for key, _ in candidates]
            chunks = candidates[: admitted.index(False)] if False in admitted else candidates
        if not chunks:
            return StoreGroup(pool, fingerprint, [], {}, [])
        owner = self.owner(pool, fingerprint)
        reservation = pool.cpu.reserve((key for key, _ in chunks), owner, fingerprint, parents=parents)
        if reservation is None and partial:
            reservation, chunks = self._reserve_prefix(pool, chunks, owner, fingerprint, parents)
        if reservation is None:
            return None
        return StoreGroup(pool, fingerprint, chunks, reservation.slots, reservation.evicted)

    @staticmethod
    def _reserve_prefix(
        pool: Pool,
        chunks: list[tuple[ChunkKey, tuple[int, ...]]],
        owner: str,
        namespace: str,
        parents: dict[ChunkKey, ChunkKey | None],
    ) -> tuple[Reservation | None, list[tuple[ChunkKey, tuple[int, ...]]]]:
        """Reserve chunks one at a time, in prefix order, until one does not fit."""
        slots: dict[ChunkKey, int] = {}
        evicted: list[Victim] = []
        for key, _ in chunks:
            one = pool.cpu.reserve([key], owner, namespace, parents=parents)
            if one is None:
                break
            slots.update(one.slots)
            evicted += one.evicted
        if not slots:
            return None, []
        return Reservation(slots, evicted), chunks[: len(slots)]

    def complete_store(self, group: StoreGroup, ok: bool) -> list[ChunkKey]:
        """The copy into ``group``'s cpu slots finished (READY) or failed or was
        cancelled (dropped). The keys the write-through policy wants on nvme and the
        remote tier now."""
        pool = group.pool
        if not ok:
            for key, _ in group.chunks:
                pool.cpu.drop(key)
            return []
        keys = [key for key, _ in group.chunks]
        pool.cpu.mark_ready_many(keys)
        self.telemetry.emit_many(KVEventKind.STORED, "cpu", group.namespace, pool.group, keys)
        self.telemetry.bytes_moved["gpu->cpu"] += pool.chunk_bytes * len(group.chunks)
        if pool.policy.write_policy is WritePolicy.WRITE_THROUGH and (pool.nvme is not None or pool.hint is not None):
            return [key for key, _ in group.chunks]
        return []

    # -- cpu → nvme --------------------------------------------------------------------
    def plan_nvme_copy(self, pool: Pool, keys: list[ChunkKey], namespace: str) -> NvmeWrite | None:
        """Write-through and selective: copy those of ``keys`` that are READY in cpu for
        ``namespace`` and that nvme lacks, pinned in cpu meanwhile; ``None`` when none
        needs it or nvme has no room."""
        nvme = pool.nvme
        if nvme is None:
            return None
        wanted = keys
        # Usually every key is READY and none on nvme: found in C, with no step per key.
        if pool.cpu.ready_run(keys, namespace, 0, len(keys)) < len(keys) or nvme.any_resident(keys):
            wanted = [key for key in keys if pool.cpu.ready_for(key, namespace) and key not in nvme]
        chunks = pool.cpu.pin_for_copy(wanted)
        write = self._plan_nvme_write(pool, chunks, pinned=wanted)
        if write is None:
            for key in wanted:
                pool.cpu.unpin(key)
        return write

    def plan_spill(self, pool: Pool, evicted: list[Victim]) -> NvmeWrite | None:
        """Write-back: copy chunks the cpu tier just evicted to nvme before their slots are
        reused (their bytes are still there; the slots now belong to PENDING chunks)."""
        if pool.policy.write_policy is not WritePolicy.WRITE_BACK or pool.nvme is None or not evicted:
            return None
        # Victims go leaves first; nvme takes them ancestors first, so that each finds its
        # predecessor there already (the index records only such predecessors).
        spilled = [victim for victim in reversed(evicted) if victim.key not in pool.nvme]
        return self._plan_nvme_write(pool, spilled, pinned=[])

    def _plan_nvme_write(self, pool: Pool, chunks: Sequence[Victim], pinned: list[ChunkKey]) -> NvmeWrite | None:
        """nvme slots in their owners' shares for chunks in cpu slots; chunks no share has
        room for are left out."""
        assert pool.nvme is not None
        planned: list[tuple[ChunkKey, int, int]] = []
        tenants: set[ChunkKey] = set()
        shares = dict.fromkeys((chunk.owner, chunk.namespace) for chunk in chunks)
        parents = {c.key: c.parent for c in chunks}
        for owner, namespace in shares:
            mine = chunks if len(shares) == 1 else [c for c in chunks if (c.owner, c.namespace) == (owner, namespace)]
            keys = [c.key for c in mine]
            reservation = pool.nvme.reserve(keys, owner, namespace, parents=parents, keep=pool.claims)
            if reservation is None:
                log.info("tier.full", tier="nvme", namespace=owner, n_chunks=len(mine))
                continue
            self._evicted(pool, "nvme", reservation.evicted)
            planned += zip(keys, [c.slot for c in mine], map(reservation.slots.__getitem__, keys), strict=True)
            if namespace != pool.fingerprint:
                tenants.update(keys)
        if not planned:
            return None
        return NvmeWrite(pool, planned, pinned, tenants)

    def complete_nvme_write(self, write: NvmeWrite, ok: bool) -> list[int]:
        """The write finished (READY on nvme) or failed or was cancelled (dropped); the
        nvme slots whose contents the store must stop vouching for."""
        pool = write.pool
        assert pool.nvme is not None
        pool.cpu.unpin_many(write.pinned)
        if not ok:
            return [pool.nvme.drop(key) for key, _, _ in write.chunks]
        keys = [key for key, _, _ in write.chunks]
        self.telemetry.emit_each(KVEventKind.STORED, "nvme", pool.nvme.mark_ready_many(keys), pool.group, keys)
        self.telemetry.bytes_moved["cpu->nvme"] += pool.chunk_bytes * len(write.chunks)
        return []

    # -- nvme → cpu --------------------------------------------------------------------
    def plan_promotion(self, pool: Pool, key: ChunkKey, namespace: str) -> Promotion | bool:
        """Reserve a cpu slot for ``namespace``'s nvme chunk ``key`` and pin its nvme slot.
        ``True`` when cpu holds it ready already, ``False`` when it cannot come in now
        (gone from nvme, being stored, or no cpu room)."""
        if pool.nvme is None or not pool.nvme.ready_for(key, namespace):
            return False  # evicted from nvme since the lookup
        if pool.cpu.ready_for(key, namespace):
            return True  # another path brought it in meanwhile
        if key in pool.cpu:
            return False  # a store of it is in flight: not a hit yet
        nvme_slot = pool.nvme.pin(key)
        owner = pool.nvme.owner(key)
        reservation = pool.cpu.reserve([key], owner, namespace, parents={key: pool.nvme.parent(key)})
        if reservation is None:
            pool.nvme.unpin(key)
            log.info("tier.full", tier="cpu", namespace=pool.fingerprint, reason="promotion")
            return False
        self._evicted(pool, "cpu", reservation.evicted)
        return Promotion(pool, key, namespace, reservation.slots[key], nvme_slot, reservation.evicted)

    def complete_promotion(self, promotion: Promotion, outcome: PromotionOutcome) -> list[int]:
        """The read finished (READY in cpu), failed, or found corrupt bytes (the nvme copy
        is dropped unless a reader still pins it); the nvme slots to stop vouching for."""
        pool, key = promotion.pool, promotion.key
        assert pool.nvme is not None
        pool.nvme.unpin(key)
        if outcome is PromotionOutcome.DONE:
            pool.nvme.hit(key)
            pool.cpu.mark_ready(key)
            self.telemetry.bytes_moved["nvme->cpu"] += pool.chunk_bytes
            self.telemetry.emit(KVEventKind.STORED, "cpu", promotion.namespace, pool.group, key)
            return []
        pool.cpu.drop(key)
        if outcome is PromotionOutcome.CORRUPT and key in pool.nvme and not pool.nvme.pins(key):
            self.telemetry.emit(KVEventKind.REMOVED, "nvme", pool.nvme.namespace(key), pool.group, key)
            return [pool.nvme.drop(key)]
        return []

    # -- remote → cpu ------------------------------------------------------------------
    def plan_remote_promotion(
        self, pool: Pool, key: ChunkKey, namespace: str, parent: ChunkKey | None = None
    ) -> RemotePromotion | bool:
        """Reserve a cpu slot for ``namespace``'s chunk ``key``, which the remote tier
        likely holds (``parent``: its predecessor in the prompt, when the load knows it).
        ``True`` when cpu holds it ready already, ``False`` when it cannot come in now
        (not likely remote, being stored or promoted, or no cpu room)."""
        if pool.cpu.ready_for(key, namespace):
            return True
        if pool.hint is None or not pool.hint.likely(key, namespace) or key in pool.cpu:
            return False
        reservation = pool.cpu.reserve([key], self.owner(pool, namespace), namespace, parents={key: parent})
        if reservation is None:
            log.info("tier.full", tier="cpu", namespace=pool.fingerprint, reason="promotion")
            return False
        self._evicted(pool, "cpu", reservation.evicted)
        return RemotePromotion(pool, key, namespace, reservation.slots[key], reservation.evicted)

    def complete_remote_promotion(self, promotion: RemotePromotion, ok: bool) -> None:
        """The read brought the verified chunk (READY in cpu), or found none — absent,
        evicted, corrupt (the store deleted it), unreachable — or was cancelled: dropped,
        and the hint learns it is gone."""
        pool, key, namespace = promotion.pool, promotion.key, promotion.namespace
        assert pool.hint is not None
        if ok:
            pool.cpu.mark_ready(key)
            pool.hint.note_present([key], namespace)
            self.telemetry.bytes_moved["remote->cpu"] += pool.chunk_bytes
            self.telemetry.emit(KVEventKind.STORED, "cpu", namespace, pool.group, key)
            return
        pool.cpu.drop(key)
        self.telemetry.emit_many(
            KVEventKind.REMOVED, "remote", namespace, pool.group, pool.hint.note_absent([key], namespace)
        )

    # -- cpu → remote ------------------------------------------------------------------
    def plan_remote_copy(self, pool: Pool, keys: Iterable[ChunkKey], namespace: str) -> RemoteWrite | None:
        """Write-through and selective: copy ``namespace``'s READY cpu chunks that the
        remote tier likely lacks, pinned in cpu meanwhile; ``None`` when none needs it."""
        hint = pool.hint
        if hint is None:
            return None
        wanted = [
            key for key in dict.fromkeys(keys) if pool.cpu.ready_for(key, namespace) and not hint.likely(key, namespace)
        ]
        if not wanted:
            return None
        return RemoteWrite(pool, namespace, [(key, pool.cpu.pin(key)) for key in wanted], pinned=wanted)

    def plan_remote_spill(self, pool: Pool, evicted: list[Victim]) -> list[RemoteWrite]:
        """Write-back: copy chunks the cpu tier just evicted to the remote tier before their
        slots are reused, one write per namespace; none for chunks it likely holds."""
        hint = pool.hint
        if pool.policy.write_policy is not WritePolicy.WRITE_BACK or hint is None:
            return []
        chunks: dict[str, list[tuple[ChunkKey, int]]] = {}
        for victim in evicted:
            if not hint.likely(victim.key, victim.namespace):
                chunks.setdefault(victim.namespace, []).append((victim.key, victim.slot))
        return [RemoteWrite(pool, namespace, mine, pinned=[]) for namespace, mine in chunks.items()]

    def complete_remote_write(self, write: RemoteWrite, landed: Sequence[bool]) -> None:
        """The write finished: ``landed[i]`` says whether ``write.chunks[i]`` reached the
        store (none did for a write that failed or was cancelled)."""
        pool, namespace = write.pool, write.namespace
        assert pool.hint is not None
        for key in write.pinned:
            pool.cpu.unpin(key)
        done = [key for (key, _), ok in zip(write.chunks, landed, strict=True) if ok]
        pool.hint.note_present(done, namespace)
        if len(done) < len(write.chunks):
            pool.hint.note_absent([key for (key, _), ok in zip(write.chunks, landed, strict=True) if not ok], namespace)
        self.telemetry.emit_many(KVEventKind.STORED, "remote", namespace, pool.group, done)
        self.telemetry.bytes_moved["cpu->remote"] += pool.chunk_bytes * len(done)

    # -- observation -------------------------------------------------------------------
    def usage(self) -> tuple[list[TierUsage], list[NamespaceUsage]]:
        """Every tier's capacity and use over all pools, and every namespace's share."""
        tiers = []
        for name in ("cpu", "nvme"):
            present = [
                (index, pool.chunk_bytes)
                for pool in self.pools.values()
                for index in pool.indexes()
                if index.tier == name
            ]
            if present:
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
            for pool in self.pools.values()
            for index in pool.indexes()
            for owner in index.partition.namespaces()
        ]
        return tiers, shares

    def verify_invariants(self) -> None:
        """Raise if any residency index contradicts itself (for tests and debugging)."""
        for pool in self.pools.values():
            for index in pool.indexes():
                index.check()

    def _evicted(self, pool: Pool, tier: str, evicted: list[Victim]) -> None:
        if not evicted:
            return
        self.telemetry.emit_each(
            KVEventKind.REMOVED,
            tier,
            [victim.namespace for victim in evicted],
            pool.group,
            [victim.key for victim in evicted],
        )
        log.debug("chunk.evicted", namespace=pool.fingerprint, tier=tier, n_chunks=len(evicted))

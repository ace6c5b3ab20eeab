"""What :meth:`TieredKV.statistics` and :meth:`TieredKV.drain_events` return."""

from __future__ import annotations

import enum

import msgspec

from tiered_kv.interfaces import RemoteTierStats, TierStats
from tiered_kv.remote_hint import ResidencyHintStats


class TierUsage(msgspec.Struct, frozen=True, kw_only=True):
    tier: str
    capacity_chunks: int
    used_chunks: int
    pinned_chunks: int
    capacity_bytes: int
    used_bytes: int


class NamespaceUsage(msgspec.Struct, frozen=True, kw_only=True):
    """One namespace's share of one tier of one KV group (a model, or one of its tenants)."""

    #: The namespace fingerprint (hex); a model's tenants (LoRA, cache salt) have their own.
    namespace: str
    model_id: str
    tier: str
    group: int
    used_chunks: int
    #: Chunks of the tier reserved for this namespace (0: it only shares the rest).
    quota_chunks: int


class RemotePoolStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """One pool's remote tier: what its driver's ops came to and what its hint holds."""

    #: The model runner's base namespace fingerprint (hex) and KV group.
    namespace: str
    model_id: str
    group: int
    driver: RemoteTierStats
    hint: ResidencyHintStats


#: Upper bounds (ms) of the load-latency histogram's buckets; one more bucket counts the rest.
LOAD_LATENCY_BOUNDS_MS: tuple[float, ...] = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500)


class LatencyHistogram(msgspec.Struct, frozen=True, kw_only=True):
    """Fixed buckets, so its memory is bounded however many loads it counts."""

    #: Upper bound of each bucket in ms; ``counts`` has one more entry, for the rest.
    bounds_ms: tuple[float, ...]
    #: Loads per bucket (not cumulative).
    counts: list[int]
    sum_ms: float
    count: int


class Statistics(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of one :class:`TieredKV`; every counter is cumulative since start."""

    tiers: list[TierUsage]
    #: Every namespace's share of every tier, per KV group.
    namespaces: list[NamespaceUsage]
    #: Chunk positions that lookups asked for, by result: ``hit_cpu`` (every KV group
    #: holds the chunk in cpu), ``hit_nvme`` (some group needs it from nvme),
    #: ``hit_remote`` (some group needs it from the remote tier, which likely holds it:
    #: the load may find it gone), ``miss`` (beyond the ready prefix). The hit rate is
    #: ``hit_* / sum``. Every lookup call counts, so an engine that asks twice for a
    #: request counts its chunks twice.
    lookups: dict[str, int]
    #: Chunks loads staged by source tier (``cpu``, or ``nvme`` or ``remote`` for a
    #: promotion), counted per KV group, also for a load that then returned fewer tokens
    #: (see ``loads_rejected``).
    loaded_chunks: dict[str, int]
    #: Time of each ``load`` call that reached its copies (rejected loads are not timed).
    load_latency: LatencyHistogram
    #: Bytes moved per direction, e.g. ``"gpu->cpu"``, ``"cpu->remote"``, ``"remote->cpu"``.
    bytes_moved: dict[str, int]
    #: ``stores``: chunks submitted and not yet read from the GPU; ``write_behind``: chunks
    #: queued for nvme; ``loads``: loads in flight; ``copies_waiting`` and ``nvme_io_waiting``:
    #: copies waiting for a GPU copy slot or an nvme I/O slot; ``background_tasks``:
    #: scheduler tasks; ``promotion_claims``: loads waiting on a chunk's promotion into
    #: cpu (one per load and chunk). With a remote tier also ``remote_writes`` (chunks queued for it)
    #: and ``remote_io_waiting`` (calls waiting for one of its I/O slots).
    queue_depths: dict[str, int]
    #: Loads that returned fewer tokens than asked, by reason: ``span`` (a sliding-window
    #: span out of bounds: nothing loaded), ``block_table`` (a block id outside the
    #: registered cache: nothing loaded), ``transfer`` (a copy failed, or a chunk left
    #: its tier between lookup and load — for the remote tier: was evicted, lost, corrupt
    #: or unreachable —: a full-attention model keeps the good prefix, a hybrid one and a
    #: failed copy to the GPU load nothing).
    loads_rejected: dict[str, int]
    #: Stores refused whole because no tier had room (``cannot store now``).
    stores_rejected: int
    #: KV events dropped because nobody drained the bounded event stream.
    events_dropped: int
    #: Every driver's own counters (ops, bytes, errors), gpu drivers once per rank.
    drivers: list[TierStats]
    #: Per pool with a remote tier: its driver's outcomes and its residency hint.
    remote: list[RemotePoolStatistics] = msgspec.field(default_factory=list)


class KVEventKind(enum.StrEnum):
    STORED = "stored"
    REMOVED = "removed"


class KVEvent(msgspec.Struct, frozen=True, kw_only=True, tag=True, gc=False):
    """A chunk became ready in, or left, a tier; for routers that track cache residency."""

    kind: KVEventKind
    tier: str
    #: The namespace fingerprint (hex).
    namespace: str
    group: int
    key: bytes

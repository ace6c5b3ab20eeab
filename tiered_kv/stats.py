"""What :meth:`TieredKV.statistics` and :meth:`TieredKV.drain_events` return."""

from __future__ import annotations

import enum

import msgspec

from tiered_kv.interfaces import TierStats


class TierUsage(msgspec.Struct, frozen=True, kw_only=True):
    tier: str
    capacity_chunks: int
    used_chunks: int
    pinned_chunks: int
    capacity_bytes: int
    used_bytes: int


class Statistics(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of one :class:`TieredKV`; every counter is cumulative since start."""

    tiers: list[TierUsage]
    #: Chunks each tier held for loads (staged in cpu, promoted from nvme), counted per
    #: KV group, also for a load that then returned fewer tokens (see ``loads_rejected``).
    hits: dict[str, int]
    #: Chunk positions lookups asked for beyond the ready prefix they found; every lookup
    #: call counts, so an engine that asks twice for a request counts its misses twice.
    misses: int
    #: Bytes moved per direction, e.g. ``"gpu->cpu"``.
    bytes_moved: dict[str, int]
    #: ``stores``: chunks submitted and not yet read from the GPU; ``write_behind``: chunks
    #: queued for nvme; ``loads``: loads in flight; ``background_tasks``: scheduler tasks.
    queue_depths: dict[str, int]
    #: Loads that returned fewer tokens than asked, by reason: ``span`` (a sliding-window
    #: span out of bounds: nothing loaded), ``block_table`` (a block id outside the
    #: registered cache: nothing loaded), ``transfer`` (a copy failed, or a chunk left
    #: its tier between lookup and load: a full-attention model keeps the good prefix, a
    #: hybrid one and a failed copy to the GPU load nothing).
    loads_rejected: dict[str, int]
    #: Stores refused whole because no tier had room (``cannot store now``).
    stores_rejected: int
    #: KV events dropped because nobody drained the bounded event stream.
    events_dropped: int
    #: Every driver's own counters (ops, bytes, errors), gpu drivers once per rank.
    drivers: list[TierStats]


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

"""What a manager counts and announces: lookup results, loads, bytes moved, KV events.

Counting is plain integer arithmetic on the hot paths; :meth:`Telemetry.statistics`
assembles the frozen :class:`~tiered_kv.stats.Statistics` record only when asked.
KV events (a chunk became ready in, or left, a tier) go to a bounded queue that routers
drain; what overflows is counted, never kept. The queue holds them as they come, a batch
of keys per call, and builds the :class:`~tiered_kv.stats.KVEvent` records only when
they are drained: a store of 16 chunks costs one append, not 16 records.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterable, Sequence

import msgspec

from tiered_kv.checks import is_int_at_least
from tiered_kv.errors import TieredKVError
from tiered_kv.interfaces import TierStats
from tiered_kv.keys import ChunkKey
from tiered_kv.stats import (
    LOAD_LATENCY_BOUNDS_MS,
    KVEvent,
    KVEventKind,
    LatencyHistogram,
    NamespaceUsage,
    RemotePoolStatistics,
    Statistics,
    TierUsage,
)


class _Batch(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """The KV events of one emit: one per key. Like the records it becomes, it is outside
    the cyclic garbage collector (a full queue of plain tuples would be walked by every
    full collection), and its keys are a tuple of ``bytes``, which the collector stops
    tracking; the copy also keeps the batch from changing with the caller's list."""

    kind: KVEventKind
    tier: str
    namespace: str
    group: int
    keys: tuple[ChunkKey, ...]


class Telemetry:
    """Counters and the KV event stream of one manager."""

    def __init__(self, max_events: int) -> None:
        self.hit_cpu = 0
        self.hit_nvme = 0
        self.hit_remote = 0
        self.missed = 0
        #: Chunks staged for loads, by source tier, per KV group.
        self.loaded: collections.Counter[str] = collections.Counter()
        self.bytes_moved: collections.Counter[str] = collections.Counter()
        self.loads_rejected: collections.Counter[str] = collections.Counter()
        self.stores_rejected = 0
        self._latency = [0] * (len(LOAD_LATENCY_BOUNDS_MS) + 1)
        self._latency_ms = 0.0
        self._max_events = max_events
        #: One batch per emit, oldest first; the first batch's leading ``_taken`` keys
        #: were drained or dropped already.
        self._batches: collections.deque[_Batch] = collections.deque()
        self._taken = 0
        self._held = 0  # events in _batches
        self.events_dropped = 0

    def load_timed(self, ms: float) -> None:
        self._latency[bisect.bisect_left(LOAD_LATENCY_BOUNDS_MS, ms)] += 1
        self._latency_ms += ms

    def emit(self, kind: KVEventKind, tier: str, namespace: str, group: int, key: ChunkKey) -> None:
        self._batches.append(_Batch(kind, tier, namespace, group, (key,)))
        self._held += 1
        if self._held > self._max_events:
            self._drop(self._held - self._max_events)

    def emit_many(self, kind: KVEventKind, tier: str, namespace: str, group: int, keys: Sequence[ChunkKey]) -> None:
        """One event of ``kind`` per key of ``keys``."""
        if not keys:
            return
        self._batches.append(_Batch(kind, tier, namespace, group, tuple(keys)))
        self._held += len(keys)
        if self._held > self._max_events:
            self._drop(self._held - self._max_events)

    def emit_each(
        self, kind: KVEventKind, tier: str, namespaces: Sequence[str], group: int, keys: Sequence[ChunkKey]
    ) -> None:
        """One event of ``kind`` per key of ``keys``, each in the namespace at its position
        in ``namespaces``: a batch per run of one namespace."""
        if not keys:
            return
        if namespaces.count(namespaces[0]) == len(namespaces):  # the common case: one namespace
            self.emit_many(kind, tier, namespaces[0], group, keys)
            return
        start = 0
        for i in range(1, len(keys) + 1):
            if i == len(keys) or namespaces[i] != namespaces[start]:
                self.emit_many(kind, tier, namespaces[start], group, keys[start:i])
                start = i

    def _drop(self, n: int) -> None:
        """Forget the ``n`` oldest events."""
        self.events_dropped += n
        self._held -= n
        batches = self._batches
        while n:
            left = len(batches[0].keys) - self._taken
            if left > n:
                self._taken += n
                return
            batches.popleft()
            self._taken = 0
            n -= left

    def drain_events(self, max_events: int | None = None) -> list[KVEvent]:
        """Take up to ``max_events`` KV events (all when ``None``), oldest first.

        The records are built here, a fraction of a µs each: draining a full queue of
        65,536 events holds the loop for 10–20 ms on the development VM; a router that
        drains ``max_events`` at a time holds it for that many only."""
        if max_events is not None and not is_int_at_least(max_events, 0):
            raise TieredKVError(f"max_events must be a non-negative integer or None, got {max_events!r}")
        wanted = self._held if max_events is None else min(max_events, self._held)
        events: list[KVEvent] = []
        append, extend, popleft, batches = events.append, events.extend, self._batches.popleft, self._batches
        need = wanted
        while need:
            batch = batches[0]
            keys, start = batch.keys, self._taken
            left = len(keys) - start
            if left <= need:
                popleft()
                self._taken = 0
                need -= left
                if left == 1:  # a batch of one, or the last key of one: no slice, no list
                    append(
                        KVEvent(
                            kind=batch.kind, tier=batch.tier, namespace=batch.namespace, group=batch.group, key=keys[-1]
                        )
                    )
                    continue
                part = keys[start:] if start else keys
            else:
                part = keys[start : start + need]
                self._taken = start + need
                need = 0
            kind, tier, namespace, group = batch.kind, batch.tier, batch.namespace, batch.group
            extend([KVEvent(kind=kind, tier=tier, namespace=namespace, group=group, key=key) for key in part])
        self._held -= wanted
        return events

    def statistics(
        self,
        *,
        tiers: list[TierUsage],
        namespaces: list[NamespaceUsage],
        queue_depths: dict[str, int],
        drivers: Iterable[TierStats],
        remote: Iterable[RemotePoolStatistics] = (),
    ) -> Statistics:
        lookups = {
            "hit_cpu": self.hit_cpu,
            "hit_nvme": self.hit_nvme,
            "hit_remote": self.hit_remote,
            "miss": self.missed,
        }
        return Statistics(
            tiers=tiers,
            namespaces=namespaces,
            lookups={result: count for result, count in lookups.items() if count},
            loaded_chunks=dict(self.loaded),
            load_latency=LatencyHistogram(
                bounds_ms=LOAD_LATENCY_BOUNDS_MS,
                counts=list(self._latency),
                sum_ms=self._latency_ms,
                count=sum(self._latency),
            ),
            bytes_moved=dict(self.bytes_moved),
            queue_depths=queue_depths,
            loads_rejected=dict(self.loads_rejected),
            stores_rejected=self.stores_rejected,
            events_dropped=self.events_dropped,
            drivers=list(drivers),
            remote=list(remote),
        )

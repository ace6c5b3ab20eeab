"""What a manager counts and announces: lookup results, loads, bytes moved, KV events.

Counting is plain integer arithmetic on the hot paths; :meth:`Telemetry.statistics`
assembles the frozen :class:`~tiered_kv.stats.Statistics` record only when asked.
KV events (a chunk became ready in, or left, a tier) go to a bounded deque that routers
drain; what overflows is counted, never kept.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterable

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
        self._events: collections.deque[KVEvent] = collections.deque(maxlen=max_events)
        self.events_dropped = 0

    def load_timed(self, ms: float) -> None:
        self._latency[bisect.bisect_left(LOAD_LATENCY_BOUNDS_MS, ms)] += 1
        self._latency_ms += ms

    def emit(self, kind: KVEventKind, tier: str, namespace: str, group: int, key: ChunkKey) -> None:
        if len(self._events) == self._events.maxlen:
            self.events_dropped += 1
        self._events.append(KVEvent(kind=kind, tier=tier, namespace=namespace, group=group, key=key))

    def drain_events(self, max_events: int | None = None) -> list[KVEvent]:
        """Take up to ``max_events`` KV events (all when ``None``), oldest first."""
        if max_events is not None and not is_int_at_least(max_events, 0):
            raise TieredKVError(f"max_events must be a non-negative integer or None, got {max_events!r}")
        count = len(self._events) if max_events is None else min(max_events, len(self._events))
        return [self._events.popleft() for _ in range(count)]

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

"""Prometheus metrics of a :class:`~tiered_kv.TieredKV`, read from ``statistics()`` when
Prometheus scrapes (the ``prometheus`` extra: ``pip install 'tiered-kv[prometheus]'``).

One call registers them into the server's registry::

    from tiered_kv.metrics import register_metrics
    register_metrics(kv)  # from the event loop that runs kv; REGISTRY unless registry=...

Nothing is counted on the hot path: the manager keeps its counters anyway, and a scrape
turns one :class:`~tiered_kv.stats.Statistics` snapshot into metric families. The
snapshot is taken on the loop that runs the manager (whose state only that loop may
read), also when the scrape comes from another thread, as prometheus-client's HTTP
server's does; that thread waits up to ``timeout_s`` for it.

Labels are bounded: tiers, KV groups, directions, results and reasons are fixed sets,
and per-namespace gauges name at most ``max_namespaces`` namespaces, those holding the
most chunks; the rest are summed under ``namespace="other"``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING

try:
    from prometheus_client.core import (
        REGISTRY,
        CollectorRegistry,
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
    )
except ImportError as exc:
    raise ImportError("tiered_kv.metrics needs prometheus-client: pip install 'tiered-kv[prometheus]'") from exc

from tiered_kv.stats import NamespaceUsage, Statistics

if TYPE_CHECKING:
    from tiered_kv.manager import TieredKV

#: Namespaces the per-namespace gauges name by default; more are summed as ``other``.
MAX_NAMESPACES = 32
#: The label value of the namespaces beyond ``max_namespaces``.
OTHER = "other"

_TIER_GAUGES = {
    "capacity_bytes": "Bytes the tier can hold",
    "used_bytes": "Bytes of chunks the tier holds",
    "capacity_chunks": "Chunk slots of the tier",
    "used_chunks": "Chunks the tier holds",
    "pinned_chunks": "Chunks being read or written, which eviction skips",
}


class TieredKVCollector:
    """A prometheus-client collector over one :class:`TieredKV`; see the module docstring."""

    def __init__(
        self,
        kv: TieredKV,
        loop: asyncio.AbstractEventLoop,
        *,
        max_namespaces: int = MAX_NAMESPACES,
        timeout_s: float = 5.0,
    ) -> None:
        if max_namespaces < 1:
            raise ValueError(f"max_namespaces must be at least 1, got {max_namespaces}")
        self._kv = kv
        self._loop = loop
        self._max_namespaces = max_namespaces
        self._timeout_s = timeout_s

    def describe(self) -> Iterator[Metric]:
        """The families without samples: registering takes no snapshot."""
        return _families(None, self._max_namespaces)

    def collect(self) -> Iterator[Metric]:
        return _families(self.snapshot(), self._max_namespaces)

    def snapshot(self) -> Statistics:
        """``kv.statistics()``, taken on the manager's loop; :class:`TimeoutError` when the
        loop does not get to it within ``timeout_s`` (the scrape then fails: a loop stalled
        that long is what an alert should see)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            return self._kv.statistics()
        result: concurrent.futures.Future[Statistics] = concurrent.futures.Future()

        def take() -> None:
            if result.set_running_or_notify_cancel():
                try:
                    result.set_result(self._kv.statistics())
                except Exception as exc:  # handed to the scraping thread
                    result.set_exception(exc)

        self._loop.call_soon_threadsafe(take)
        try:
            return result.result(timeout=self._timeout_s)
        except concurrent.futures.TimeoutError:
            result.cancel()
            raise TimeoutError(f"the TieredKV's event loop gave no statistics within {self._timeout_s} s") from None


def register_metrics(
    kv: TieredKV,
    registry: CollectorRegistry = REGISTRY,
    *,
    max_namespaces: int = MAX_NAMESPACES,
    timeout_s: float = 5.0,
) -> TieredKVCollector:
    """Register ``kv``'s metrics into ``registry``; call from the loop that runs ``kv``.

    Returns the collector (``registry.unregister(collector)`` removes it again).
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError(
            "register_metrics(kv) reads kv's statistics on kv's event loop: call it from that loop "
            "(or construct TieredKVCollector(kv, loop) and register it yourself)"
        ) from None
    collector = TieredKVCollector(kv, loop, max_namespaces=max_namespaces, timeout_s=timeout_s)
    registry.register(collector)
    return collector


def _families(stats: Statistics | None, max_namespaces: int) -> Iterator[Metric]:
    """The metric families of ``stats``; without samples when ``stats`` is None."""
    for field, doc in _TIER_GAUGES.items():
        gauge = GaugeMetricFamily(f"tiered_kv_tier_{field}", doc, labels=["tier"])
        for tier in stats.tiers if stats else ():
            gauge.add_metric([tier.tier], getattr(tier, field))
        yield gauge
    yield _counter(
        "tiered_kv_lookup_chunks",
        "Chunk positions lookups asked for, by result (hit_cpu, hit_nvme, miss): the hit rate's unit",
        "result",
        stats.lookups if stats else {},
    )
    yield _counter(
        "tiered_kv_loaded_chunks",
        "Chunks loads staged, by the tier they came from, per KV group",
        "tier",
        stats.loaded_chunks if stats else {},
    )
    yield _load_latency(stats)
    moved = CounterMetricFamily("tiered_kv_moved_bytes", "Bytes moved, by direction", labels=["src", "dst"])
    for direction, nbytes in (stats.bytes_moved if stats else {}).items():
        src, _, dst = direction.partition("->")
        moved.add_metric([src, dst], nbytes)
    yield moved
    depth = GaugeMetricFamily("tiered_kv_queue_depth", "Work queued or in flight, by queue", labels=["queue"])
    for queue, n in (stats.queue_depths if stats else {}).items():
        depth.add_metric([queue], n)
    yield depth
    yield _counter(
        "tiered_kv_loads_rejected",
        "Loads that returned fewer tokens than asked, by reason",
        "reason",
        stats.loads_rejected if stats else {},
    )
    stores = CounterMetricFamily("tiered_kv_stores_rejected", "Stores refused whole: no tier had room")
    events = CounterMetricFamily("tiered_kv_events_dropped", "KV events dropped: nobody drained the stream")
    if stats:
        stores.add_metric([], stats.stores_rejected)
        events.add_metric([], stats.events_dropped)
    yield stores
    yield events
    yield from _namespaces(stats.namespaces if stats else [], max_namespaces)
    yield from _drivers(stats)


def _counter(name: str, doc: str, label: str, values: dict[str, int]) -> CounterMetricFamily:
    counter = CounterMetricFamily(name, doc, labels=[label])
    for value, count in values.items():
        counter.add_metric([value], count)
    return counter


def _load_latency(stats: Statistics | None) -> HistogramMetricFamily:
    histogram = HistogramMetricFamily(
        "tiered_kv_load_latency_seconds", "Time of each load call that reached its copies (time to first token)"
    )
    if stats:
        latency = stats.load_latency
        bounds = [f"{bound / 1000:g}" for bound in latency.bounds_ms] + ["+Inf"]
        buckets = list(zip(bounds, itertools.accumulate(latency.counts), strict=True))
        histogram.add_metric([], buckets, latency.sum_ms / 1000)
    return histogram


def _namespaces(shares: list[NamespaceUsage], max_namespaces: int) -> Iterator[Metric]:
    """Used and quota chunks per namespace, tier and group; the namespaces holding the most
    chunks by name, the rest summed as ``other``."""
    held: dict[str, int] = defaultdict(int)
    for share in shares:
        held[share.namespace] += share.used_chunks
    named = set(sorted(held, key=lambda ns: (-held[ns], ns))[:max_namespaces])
    used: dict[tuple[str, str, str, str], int] = defaultdict(int)
    quota: dict[tuple[str, str, str, str], int] = defaultdict(int)
    for share in shares:
        labels = (share.namespace, share.model_id) if share.namespace in named else (OTHER, OTHER)
        key = (*labels, share.tier, str(share.group))
        used[key] += share.used_chunks
        quota[key] += share.quota_chunks
    names = ["namespace", "model", "tier", "group"]
    for metric, doc, values in (
        ("used_chunks", "Chunks a namespace holds in a tier, per KV group", used),
        ("quota_chunks", "Chunks of a tier reserved for a namespace, per KV group", quota),
    ):
        gauge = GaugeMetricFamily(f"tiered_kv_namespace_{metric}", doc, labels=names)
        for key, value in values.items():
            gauge.add_metric(list(key), value)
        yield gauge


def _drivers(stats: Statistics | None) -> Iterator[Metric]:
    """Every driver's own counters, summed per tier (a tier has a driver per pool and group)."""
    ops = CounterMetricFamily("tiered_kv_driver_ops", "Driver calls, by tier and operation", labels=["tier", "op"])
    moved = CounterMetricFamily(
        "tiered_kv_driver_bytes", "Bytes the drivers moved, by tier and operation", labels=["tier", "op"]
    )
    errors = CounterMetricFamily("tiered_kv_driver_errors", "Driver calls that failed, by tier", labels=["tier"])
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
    for driver in stats.drivers if stats else ():
        total = totals[driver.name]
        for i, count in enumerate(
            (driver.reads, driver.writes, driver.bytes_read, driver.bytes_written, driver.errors)
        ):
            total[i] += count
    for tier, (reads, writes, bytes_read, bytes_written, failed) in totals.items():
        ops.add_metric([tier, "read"], reads)
        ops.add_metric([tier, "write"], writes)
        moved.add_metric([tier, "read"], bytes_read)
        moved.add_metric([tier, "write"], bytes_written)
        errors.add_metric([tier], failed)
    yield ops
    yield moved
    yield errors

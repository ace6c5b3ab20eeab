"""Prometheus metrics: scraped as an HTTP server thread would, during a workload, and
checked number by number against ``statistics()``."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable

import pytest
import torch
from conftest import make_namespace
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tiered_kv import CpuTierConfig, NamespacePolicyConfig, NvmeTierConfig, TieredKVConfig, WritePolicy, chunk_keys
from tiered_kv.manager import TieredKV
from tiered_kv.metrics import OTHER, register_metrics
from tiered_kv.namespace import Namespace
from tiered_kv.null import NullTiers
from tiered_kv.stats import Statistics

NS = make_namespace()
CHUNK = NS.geometry.chunk_bytes()
K = NS.geometry.blocks_per_chunk
#: Engine blocks; a load into a block at or beyond it is rejected (reason block_table).
BLOCKS = 64

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(registry: CollectorRegistry) -> Samples:
    text = generate_latest(registry).decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def expected_samples(stats: Statistics) -> Samples:
    """What the exposition must say, written out from the Statistics fields."""
    out: Samples = {}

    def put(name: str, value: float, **labels: str) -> None:
        out[(name, frozenset(labels.items()))] = value

    for tier in stats.tiers:
        for field in ("capacity_bytes", "used_bytes", "capacity_chunks", "used_chunks", "pinned_chunks"):
            put(f"tiered_kv_tier_{field}", getattr(tier, field), tier=tier.tier)
    for result, n in stats.lookups.items():
        put("tiered_kv_lookup_chunks_total", n, result=result)
    for tier_name, n in stats.loaded_chunks.items():
        put("tiered_kv_loaded_chunks_total", n, tier=tier_name)
    running = 0
    for bound, n in zip([*stats.load_latency.bounds_ms, None], stats.load_latency.counts, strict=True):
        running += n
        put("tiered_kv_load_latency_seconds_bucket", running, le="+Inf" if bound is None else f"{bound / 1000:g}")
    put("tiered_kv_load_latency_seconds_count", stats.load_latency.count)
    put("tiered_kv_load_latency_seconds_sum", stats.load_latency.sum_ms / 1000)
    for direction, n in stats.bytes_moved.items():
        src, dst = direction.split("->")
        put("tiered_kv_moved_bytes_total", n, src=src, dst=dst)
    for queue, n in stats.queue_depths.items():
        put("tiered_kv_queue_depth", n, queue=queue)
    for reason, n in stats.loads_rejected.items():
        put("tiered_kv_loads_rejected_total", n, reason=reason)
    put("tiered_kv_stores_rejected_total", stats.stores_rejected)
    put("tiered_kv_events_dropped_total", stats.events_dropped)
    for share in stats.namespaces:
        labels = {"namespace": share.namespace, "model": share.model_id, "tier": share.tier, "group": str(share.group)}
        put("tiered_kv_namespace_used_chunks", share.used_chunks, **labels)
        put("tiered_kv_namespace_quota_chunks", share.quota_chunks, **labels)
    tiers = {driver.name for driver in stats.drivers}
    for tier_name in tiers:
        drivers = [d for d in stats.drivers if d.name == tier_name]
        put("tiered_kv_driver_ops_total", sum(d.reads for d in drivers), tier=tier_name, op="read")
        put("tiered_kv_driver_ops_total", sum(d.writes for d in drivers), tier=tier_name, op="write")
        put("tiered_kv_driver_bytes_total", sum(d.bytes_read for d in drivers), tier=tier_name, op="read")
        put("tiered_kv_driver_bytes_total", sum(d.bytes_written for d in drivers), tier=tier_name, op="write")
        put("tiered_kv_driver_errors_total", sum(d.errors for d in drivers), tier=tier_name)
    return out


def counters(samples: Samples) -> Samples:
    return {key: value for key, value in samples.items() if key[0].endswith(("_total", "_bucket", "_count"))}


def config() -> TieredKVConfig:
    return TieredKVConfig(
        cpu=CpuTierConfig(capacity_bytes=CHUNK * 6),
        nvme=NvmeTierConfig(root="/unused", capacity_bytes=CHUNK * 40),
        default_policy=NamespacePolicyConfig(write_policy=WritePolicy.WRITE_THROUGH),
    )


async def workload(kv: TieredKV, tenants: list[Namespace], rng: random.Random, steps: int) -> None:
    """Random stores, lookups and loads (some into blocks the engine does not have)."""
    for step in range(steps):
        ns = rng.choice(tenants)
        start = rng.randrange(8) * ns.geometry.chunk_size
        keys = chunk_keys(ns, list(range(start, start + rng.randint(1, 4) * ns.geometry.chunk_size)))
        blocks = list(range(len(keys) * K))
        if rng.random() < 0.5:
            await kv.store(ns, request_id=f"s{step}", keys=[keys], block_ids=[blocks])
            await kv.finish_request(f"s{step}")
        else:
            hit = kv.lookup(ns, [keys])
            offset = BLOCKS if rng.random() < 0.1 else 0  # out of the cache: rejected
            table = [offset + b for b in blocks[: hit * K]]
            tokens = hit * ns.geometry.chunk_size
            await kv.load(ns, request_id=f"l{step}", keys=[keys[:hit]], block_ids=[table], num_tokens=tokens)
        if step % 7 == 0:
            await asyncio.sleep(0)


async def open_kv(tenants: list[Namespace]) -> TieredKV:
    kv = TieredKV(config(), tiers=NullTiers())
    await kv.__aenter__()
    for tenant in tenants:
        if tenant.cache_salt is None:
            await kv.register(tenant, [[torch.zeros(BLOCKS, 1)]])
    return kv


def tenants_of(n: int) -> list[Namespace]:
    return [NS] + [make_namespace(cache_salt=f"t{i}") for i in range(n - 1)]


@pytest.mark.parametrize("seed", range(3))
async def test_scrapes_from_another_thread_during_a_workload_match_statistics(seed: int) -> None:
    tenants = tenants_of(3)
    kv = await open_kv(tenants)
    registry = CollectorRegistry()
    register_metrics(kv, registry)
    scrapes: list[Samples] = []
    stop = threading.Event()

    loop, scraped = asyncio.get_running_loop(), asyncio.Event()

    def scraper() -> None:  # as prometheus-client's HTTP server thread does
        while not stop.is_set():
            scrapes.append(scrape(registry))
            loop.call_soon_threadsafe(scraped.set)

    async def next_scrape() -> None:  # the scraper's thread gets its turn, however fast the loop is
        scraped.clear()
        async with asyncio.timeout(60):  # a scraper that died fails the test, not hangs it
            await scraped.wait()

    thread = threading.Thread(target=scraper)
    thread.start()
    try:
        rng = random.Random(seed)
        for _ in range(10):  # scrapes between parts of the workload, and during them
            await next_scrape()
            await workload(kv, tenants, rng, 30)
        await kv.drain()
    finally:
        stop.set()
        await asyncio.to_thread(thread.join)
    final = await asyncio.to_thread(scrape, registry)  # nothing runs on the loop meanwhile
    assert final == expected_samples(kv.statistics())
    stats = kv.statistics()
    assert set(stats.lookups) == {"hit_cpu", "hit_nvme", "miss"} and stats.loads_rejected["block_table"] > 0
    assert len(scrapes) >= 2
    for before, after in zip(scrapes, [*scrapes[1:], final], strict=True):
        assert all(after.get(key, 0) >= value for key, value in counters(before).items()), "a counter went back"
    await kv.close()


async def test_namespaces_beyond_the_cap_are_summed_as_other() -> None:
    tenants = tenants_of(6)
    kv = await open_kv(tenants)
    for i, tenant in enumerate(tenants):  # tenant i holds i + 1 chunks
        keys = chunk_keys(tenant, list(range((i + 1) * tenant.geometry.chunk_size)))
        await kv.store(tenant, request_id=str(i), keys=[keys], block_ids=[list(range(len(keys) * K))])
        await kv.finish_request(str(i))
        await kv.drain()  # on nvme before the next store needs the cpu slots
    registry = CollectorRegistry()
    register_metrics(kv, registry, max_namespaces=2)
    samples = scrape(registry)
    used = {
        dict(labels)["namespace"]: value
        for (name, labels), value in samples.items()
        if name == "tiered_kv_namespace_used_chunks" and dict(labels)["tier"] == "nvme"
    }
    shares = [s for s in kv.statistics().namespaces if s.tier == "nvme"]
    by_usage = sorted(shares, key=lambda s: -s.used_chunks)
    assert set(used) == {by_usage[0].namespace, by_usage[1].namespace, OTHER}
    assert used[OTHER] == sum(s.used_chunks for s in by_usage[2:]) and sum(used.values()) == 21
    await kv.close()


async def test_registering_takes_no_snapshot_and_each_scrape_takes_one(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = await open_kv([NS])
    calls: list[int] = []
    real: Callable[[], Statistics] = kv.statistics
    monkeypatch.setattr(kv, "statistics", lambda: calls.append(1) or real())
    registry = CollectorRegistry()
    register_metrics(kv, registry)
    assert calls == []
    scrape(registry)
    await asyncio.to_thread(scrape, registry)
    assert calls == [1, 1]
    await kv.close()


async def test_a_scrape_of_a_stalled_loop_fails_within_its_timeout() -> None:
    kv = await open_kv([NS])
    registry = CollectorRegistry()
    register_metrics(kv, registry, timeout_s=0.05)
    outcome: list[BaseException] = []

    def scrape_expecting_failure() -> None:
        try:
            scrape(registry)
        except TimeoutError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=scrape_expecting_failure)
    thread.start()
    thread.join()  # blocks the loop until the scrape gave up: a stalled loop, as a host's blocking call makes it
    assert len(outcome) == 1 and "within 0.05 s" in str(outcome[0])
    await asyncio.sleep(0)  # the late snapshot request runs now and takes nothing
    await kv.close()


async def test_register_metrics_outside_a_running_loop_is_refused() -> None:
    kv = await open_kv([NS])
    with pytest.raises(RuntimeError, match="call it from that loop"):
        await asyncio.to_thread(register_metrics, kv, CollectorRegistry())
    await kv.close()

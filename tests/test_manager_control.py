"""TieredKV's control plane over drivers that move no bytes: lifecycle, bounds, failures.

The byte-moving paths over the real drivers are in ``test_manager_data.py``.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import msgspec
import pytest
import torch
from conftest import make_namespace, mla_geometry
from structlog.testing import capture_logs

from tiered_kv import (
    CpuTierConfig,
    NamespacePolicyConfig,
    NvmeTierConfig,
    TieredKVConfig,
    TieredKVError,
    UnknownPluginError,
    WritePolicy,
    chunk_keys,
)
from tiered_kv.errors import BusyError, ConfigError
from tiered_kv.manager import TieredKV
from tiered_kv.namespace import Namespace
from tiered_kv.null import NullTier, NullTiers
from tiered_kv.stats import KVEventKind

NS = make_namespace()
CHUNK = NS.geometry.chunk_bytes()
K = NS.geometry.blocks_per_chunk


def config(
    cpu_chunks: int = 8, nvme_chunks: int | None = 32, write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
) -> TieredKVConfig:
    return TieredKVConfig(
        cpu=CpuTierConfig(capacity_bytes=CHUNK * cpu_chunks),
        nvme=NvmeTierConfig(root="/unused", capacity_bytes=CHUNK * nvme_chunks) if nvme_chunks else None,
        default_policy=NamespacePolicyConfig(policy="lru", write_policy=write_policy, selective_hits=2),
    )


def gpu_tensors(num_blocks: int = 256) -> list[list[torch.Tensor]]:
    return [[torch.zeros(num_blocks, 1)]]


def keys_for(n_chunks: int, start: int = 0, ns: Namespace = NS) -> list[bytes]:
    tokens = list(range(start, start + n_chunks * ns.geometry.chunk_size))
    return chunk_keys(ns, tokens)


def blocks_for(n_chunks: int, offset: int = 0) -> list[int]:
    return list(range(offset, offset + n_chunks * K))


class Harness:
    def __init__(self, kv: TieredKV, tiers: NullTiers) -> None:
        self.kv = kv
        self.tiers = tiers

    @property
    def gpu(self) -> NullTier:
        return self.tiers.made["gpu"][0]

    @property
    def nvme(self) -> NullTier:
        return self.tiers.made["nvme"][0]

    async def store(self, keys: list[bytes], request_id: str = "r", offset: int = 0):
        return await self.kv.store(NS, request_id=request_id, keys=[keys], block_ids=[blocks_for(len(keys), offset)])

    async def load(self, keys: list[bytes], n: int | None = None, request_id: str = "l") -> int:
        n = len(keys) if n is None else n
        return await self.kv.load(
            NS,
            request_id=request_id,
            keys=[keys],
            block_ids=[blocks_for(len(keys))],
            num_tokens=n * NS.geometry.chunk_size,
        )

    def lookup(self, keys: list[bytes]) -> int:
        return self.kv.lookup(NS, [keys])


async def open_harness(cfg: TieredKVConfig, **kwargs: int) -> Harness:
    tiers = NullTiers()
    kv = TieredKV(cfg, tiers=tiers, **kwargs)
    await kv.__aenter__()
    await kv.register(NS, gpu_tensors())
    return Harness(kv, tiers)


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    harness = await open_harness(config())
    yield harness
    await harness.kv.close(drain=False)
    harness.kv.check_invariants()


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def test_a_chunk_whose_store_is_in_flight_is_not_a_hit(h: Harness) -> None:
    keys = keys_for(3)
    h.gpu.gate.clear()
    result = await h.store(keys)
    assert (result.submitted, result.skipped, result.rejected) == (3, 0, False)
    await settle()
    assert h.lookup(keys) == 0
    h.gpu.gate.set()
    await h.kv.finish_request("r")
    assert h.lookup(keys) == 3


async def test_a_written_through_chunk_reaches_nvme_when_a_store_in_the_same_turn_needs_its_cpu_slot() -> None:
    # Regression: the copy to nvme was planned one turn of the loop after the store
    # finished, and a store planned in between (cpu full) evicted the chunks before they
    # were pinned for it: written through, they never reached nvme.
    harness = await open_harness(config(cpu_chunks=2))
    first, second = keys_for(2), keys_for(2, start=9_000)
    harness.gpu.gate.clear()
    await harness.store(first, request_id="A")
    harness.gpu.gate.set()  # A's copy finishes in the next turn of the loop, and B is planned right after it
    await asyncio.ensure_future(harness.store(second, request_id="B", offset=40))
    await harness.kv.drain()
    assert harness.kv.statistics().tiers[1].used_chunks >= 2
    assert harness.lookup(first) == 2
    await harness.kv.close()
    harness.kv.check_invariants()


@pytest.mark.parametrize("seed", range(30))
async def test_every_chunk_a_write_through_store_submits_reaches_nvme_under_concurrent_stores(seed: int) -> None:
    """Producers store distinct prompts into a cpu tier a few chunks large while the gpu
    copies stall and resume at random; nvme has room for everything. Every chunk of a
    store that submitted it must be on nvme afterwards, however the turns interleave."""
    rng = random.Random(seed)
    harness = await open_harness(config(cpu_chunks=rng.randint(2, 5), nvme_chunks=512))
    submitted: list[list[bytes]] = []

    async def producer(p: int) -> None:
        for i in range(8):
            keys = keys_for(rng.randint(1, 2), start=(p * 100 + i) * 1_000)
            result = await harness.store(keys, request_id=f"{p}-{i}", offset=p * 8)
            if result.submitted:
                submitted.append(keys[: result.submitted])
            await harness.kv.finish_request(f"{p}-{i}")
            for _ in range(rng.randrange(3)):
                await asyncio.sleep(0)

    async def chaos() -> None:
        for _ in range(40):
            if rng.random() < 0.5:
                harness.gpu.gate.clear()
            else:
                harness.gpu.gate.set()
            await asyncio.sleep(0)
        harness.gpu.gate.set()

    await asyncio.gather(chaos(), *(producer(p) for p in range(rng.randint(2, 4))))
    await harness.kv.drain()
    assert submitted
    for keys in submitted:
        assert harness.lookup(keys) == len(keys)
    await harness.kv.close()
    harness.kv.check_invariants()


async def test_finish_request_waits_until_its_stores_stop_reading_gpu_blocks(h: Harness) -> None:
    h.gpu.gate.clear()
    await h.store(keys_for(2), request_id="A")
    finished = asyncio.ensure_future(h.kv.finish_request("A"))
    await settle()
    assert not finished.done()
    assert not h.kv.finish_request_nowait("A")
    assert h.kv.finish_request_nowait("B")  # another request has nothing in flight
    h.gpu.gate.set()
    await finished
    assert h.kv.finish_request_nowait("A")


async def test_flush_waits_only_for_stores_reading_the_given_blocks(h: Harness) -> None:
    h.gpu.gate.clear()
    await h.store(keys_for(1), offset=0)
    flushed_other = asyncio.ensure_future(h.kv.flush([200, 201]))
    flushed_mine = asyncio.ensure_future(h.kv.flush([2]))
    await settle()
    assert flushed_other.done() and not flushed_mine.done()
    h.gpu.gate.set()
    await flushed_mine


async def test_already_stored_chunks_are_skipped(h: Harness) -> None:
    keys = keys_for(4)
    await h.store(keys[:2])
    await h.kv.finish_request("r")
    result = await h.store(keys)
    assert (result.submitted, result.skipped) == (2, 2)


async def test_store_that_cannot_evict_changes_nothing(h: Harness) -> None:
    keys = keys_for(8)
    h.gpu.gate.clear()  # 8 PENDING chunks fill the cpu tier and cannot be evicted
    await h.store(keys)
    before = h.kv.statistics()
    with capture_logs() as events:
        result = await h.store(keys_for(1, start=10_000))
    assert result.rejected and result.submitted == 0
    after = h.kv.statistics()
    assert after.tiers == before.tiers and after.stores_rejected == before.stores_rejected + 1
    assert any(e["event"] == "tier.full" for e in events)
    h.kv.check_invariants()
    h.gpu.gate.set()


async def test_eviction_never_takes_a_pinned_chunk() -> None:
    resident = keys_for(8)
    # A load pins chunks in cpu while it copies them to the GPU; hold it there.
    harness = await open_harness(config(nvme_chunks=None))
    await harness.store(resident)
    await harness.kv.finish_request("r")
    harness.gpu.gate.clear()
    load = asyncio.ensure_future(harness.load(resident))
    await settle()
    assert harness.kv.statistics().tiers[0].pinned_chunks == 8
    result = await harness.store(keys_for(1, start=50_000))
    assert result.rejected  # every cpu chunk is pinned: nothing may be evicted
    harness.gpu.gate.set()
    assert await load == 8 * NS.geometry.chunk_size
    result = await harness.store(keys_for(1, start=50_000))
    assert not result.rejected and result.submitted == 1
    await harness.kv.close()
    harness.kv.check_invariants()


async def test_cancelled_load_leaves_no_pin_and_a_consistent_directory(h: Harness) -> None:
    keys = keys_for(4)
    await h.store(keys)
    await h.kv.finish_request("r")
    h.gpu.gate.clear()
    load = asyncio.ensure_future(h.load(keys))
    await settle()
    assert h.kv.statistics().tiers[0].pinned_chunks == 4
    load.cancel()
    with pytest.raises(asyncio.CancelledError):
        await load
    assert h.kv.statistics().tiers[0].pinned_chunks == 0
    h.kv.check_invariants()
    h.gpu.gate.set()
    assert await h.load(keys) == 4 * NS.geometry.chunk_size


async def test_failed_gpu_read_drops_the_chunks_and_logs_transfer_failed(h: Harness) -> None:
    keys = keys_for(2)
    h.gpu.fail_keys.add(keys[1])
    with capture_logs() as events:
        await h.store(keys)
        await h.kv.finish_request("r")
    assert h.lookup(keys) == 0
    assert h.kv.statistics().tiers[0].used_chunks == 0
    failed = [e for e in events if e["event"] == "transfer.failed"]
    assert failed and failed[0]["path"] == "gpu->cpu" and failed[0]["request_id"] == "r"


async def test_nvme_read_failure_keeps_the_good_prefix() -> None:
    harness = await open_harness(config(cpu_chunks=4, nvme_chunks=16))
    keys = keys_for(4)
    await harness.store(keys)
    await harness.kv.finish_request("r")
    await harness.kv.drain()  # write-through to nvme done
    # Push the four chunks out of cpu; nvme keeps them.
    await harness.store(keys_for(4, start=90_000), offset=100)
    await harness.kv.drain()
    assert harness.lookup(keys) == 4
    harness.nvme.fail_keys.add(keys[2])
    assert await harness.load(keys) == 2 * NS.geometry.chunk_size
    stats = harness.kv.statistics()
    assert stats.loaded_chunks["nvme"] == 2 and stats.loads_rejected == {"transfer": 1}
    await harness.kv.close()
    harness.kv.check_invariants()


async def test_two_loads_of_a_chunk_on_nvme_share_one_read() -> None:
    harness = await open_harness(config(cpu_chunks=2, nvme_chunks=16))
    keys = keys_for(2)
    await harness.store(keys)
    await harness.kv.drain()
    await harness.store(keys_for(2, start=70_000), offset=100)
    await harness.kv.drain()
    reads_before = harness.nvme.statistics().reads
    harness.nvme.gate.clear()
    loads = [asyncio.ensure_future(harness.load(keys, request_id=f"l{i}")) for i in range(2)]
    await settle()
    harness.nvme.gate.set()
    assert await asyncio.gather(*loads) == [2 * NS.geometry.chunk_size] * 2
    assert harness.nvme.statistics().reads - reads_before == 2  # one read per chunk, not per load
    await harness.kv.close()


async def test_cancelling_one_of_two_loads_does_not_cancel_the_shared_read() -> None:
    harness = await open_harness(config(cpu_chunks=2, nvme_chunks=16))
    keys = keys_for(1)
    await harness.store(keys)
    await harness.kv.drain()
    await harness.store(keys_for(2, start=70_000), offset=100)
    await harness.kv.drain()
    harness.nvme.gate.clear()
    first = asyncio.ensure_future(harness.load(keys, request_id="a"))
    second = asyncio.ensure_future(harness.load(keys, request_id="b"))
    await settle()
    first.cancel()
    await settle()
    harness.nvme.gate.set()
    assert await second == NS.geometry.chunk_size
    with pytest.raises(asyncio.CancelledError):
        await first
    await harness.kv.close()
    harness.kv.check_invariants()


async def test_store_nowait_raises_busy_when_the_queue_is_full() -> None:
    harness = await open_harness(config(cpu_chunks=64), max_store_chunks=4)
    harness.gpu.gate.clear()
    harness.kv.store_nowait(NS, request_id="a", keys=[keys_for(4)], block_ids=[blocks_for(4)])
    with pytest.raises(BusyError):
        harness.kv.store_nowait(NS, request_id="b", keys=[keys_for(1, start=9000)], block_ids=[blocks_for(1, 50)])
    waiting = asyncio.ensure_future(harness.store(keys_for(1, start=9000), request_id="b", offset=50))
    await settle()
    assert not waiting.done()  # backpressure: waits for room
    harness.gpu.gate.set()
    assert (await waiting).submitted == 1
    await harness.kv.close()


async def test_a_background_bug_reaches_the_owner() -> None:
    harness = await open_harness(config())

    async def broken(ops: object) -> None:
        raise RuntimeError("driver bug")

    harness.gpu.read = broken  # type: ignore[method-assign]
    await harness.store(keys_for(1))
    await settle()
    with pytest.raises(TieredKVError, match="driver bug"):
        harness.lookup(keys_for(1))
    with pytest.raises(TieredKVError, match="driver bug"):
        await harness.kv.close()


async def test_events_report_stored_and_removed_per_tier() -> None:
    harness = await open_harness(config(cpu_chunks=2, nvme_chunks=None))
    first, second = keys_for(2), keys_for(2, start=40_000)
    await harness.store(first)
    await harness.kv.finish_request("r")
    await harness.store(second, offset=100)
    await harness.kv.finish_request("r")
    events = harness.kv.drain_events()
    stored = [e.key for e in events if e.kind is KVEventKind.STORED]
    removed = [e.key for e in events if e.kind is KVEventKind.REMOVED]
    assert stored == first + second and sorted(removed) == sorted(first)
    assert {e.tier for e in events} == {"cpu"} and {e.namespace for e in events} == {NS.fingerprint_hex}
    assert harness.kv.drain_events() == []
    await harness.kv.close()


async def test_write_back_spills_evicted_chunks_to_nvme() -> None:
    harness = await open_harness(config(cpu_chunks=2, nvme_chunks=8, write_policy=WritePolicy.WRITE_BACK))
    first = keys_for(2)
    await harness.store(first)
    await harness.kv.drain()
    assert harness.nvme.statistics().writes == 0  # write-back: nothing goes to nvme yet
    await harness.store(keys_for(2, start=40_000), offset=100)
    await harness.kv.drain()
    assert harness.nvme.statistics().writes == 2
    assert harness.lookup(first) == 2  # served from nvme now
    await harness.kv.close()


async def test_selective_writes_to_nvme_after_k_hits() -> None:
    harness = await open_harness(config(write_policy=WritePolicy.SELECTIVE))
    keys = keys_for(1)
    await harness.store(keys)
    await harness.kv.drain()
    await harness.load(keys)
    await harness.kv.drain()
    assert harness.nvme.statistics().writes == 0
    await harness.load(keys)
    await harness.kv.drain()
    assert harness.nvme.statistics().writes == 1  # selective_hits = 2
    await harness.kv.close()


async def test_replicated_ranks_share_one_copy() -> None:
    tiers = NullTiers()
    ranks = [make_namespace(geometry=mla_geometry(), tp_size=4, tp_rank=r) for r in range(4)]
    chunk = ranks[0].geometry.chunk_bytes()
    cfg = TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=chunk * 8))
    async with TieredKV(cfg, tiers=tiers) as kv:
        for ns in ranks:
            await kv.register(ns, gpu_tensors())
        keys = keys_for(4, ns=ranks[0])
        results = [
            await kv.store(ns, request_id=f"r{ns.tp_rank}", keys=[keys], block_ids=[blocks_for(4)]) for ns in ranks
        ]
        assert [r.submitted for r in results] == [4, 0, 0, 0]
        for ns in ranks:
            await kv.finish_request(f"r{ns.tp_rank}")
        assert kv.statistics().tiers[0].used_bytes == 4 * chunk
        for ns in ranks:
            assert kv.lookup(ns, [keys]) == 4
            assert await kv.load(ns, request_id="l", keys=[keys], block_ids=[blocks_for(4)], num_tokens=64) == 64
        assert len(tiers.made["cpu"]) == 1 and len(tiers.made["gpu"]) == 4


async def test_registration_errors_are_typed() -> None:
    cfg = TieredKVConfig(cpu=config().cpu, namespaces={"other": NamespacePolicyConfig(cpu_bytes=CHUNK)})
    async with TieredKV(cfg, tiers=NullTiers()) as kv:
        with pytest.raises(ConfigError, match="one list per KV group"):
            await kv.register(NS, [])
        await kv.register(NS, gpu_tensors())
        with pytest.raises(ConfigError, match="already registered"):
            await kv.register(NS, gpu_tensors())
        with pytest.raises(TieredKVError, match="not registered"):
            kv.lookup(make_namespace(model_id="other"), [[]])
        with pytest.raises(ConfigError, match="only 0 B are unassigned"):
            # The first namespace took all capacity; a second one's share no longer fits.
            await kv.register(make_namespace(model_id="other"), gpu_tensors())


async def test_closed_manager_refuses_calls() -> None:
    kv = TieredKV(config(), tiers=NullTiers())
    async with kv:
        await kv.register(NS, gpu_tensors())
    with pytest.raises(TieredKVError, match="closed"):
        kv.lookup(NS, [keys_for(1)])


async def test_repr_shows_tier_usage(h: Harness) -> None:
    await h.store(keys_for(3))
    await h.kv.finish_request("r")
    assert repr(h.kv).startswith("<TieredKV cpu=3/8 nvme=")


async def test_a_chunk_evicted_from_nvme_before_its_promotion_starts_is_a_miss() -> None:
    harness = await open_harness(config(cpu_chunks=1, nvme_chunks=4))
    keys = keys_for(1)
    await harness.store(keys)
    await harness.kv.drain()  # on nvme now
    await harness.store(keys_for(1, start=70_000), offset=100)
    await harness.kv.drain()  # and out of cpu
    load = asyncio.ensure_future(harness.load(keys))
    await asyncio.sleep(0)  # the load has started the promotion task, which has not run yet
    (pool,) = harness.kv._control.pools.values()
    assert pool.nvme is not None
    pool.nvme.drop(keys[0])  # an nvme eviction wins the race
    assert await load == 0
    harness.kv.check_invariants()
    await harness.kv.close()


async def test_tenants_of_one_model_share_its_tiers_but_never_each_others_chunks() -> None:
    tiers = NullTiers()
    async with TieredKV(config(), tiers=tiers) as kv:
        await kv.register(NS, gpu_tensors())
        alice, bob = make_namespace(cache_salt="alice"), make_namespace(cache_salt="bob")
        prompt = list(range(64))
        alice_keys, bob_keys = chunk_keys(alice, prompt), chunk_keys(bob, prompt)
        await kv.store(alice, request_id="a", keys=[alice_keys], block_ids=[blocks_for(4)])
        await kv.finish_request("a")
        assert kv.lookup(alice, [alice_keys]) == 4
        assert kv.lookup(bob, [bob_keys]) == 0  # same prompt, other tenant: a miss
        assert len(tiers.made["cpu"]) == 1  # one slab for the model, shared
        events = kv.drain_events()
        assert {e.namespace for e in events if e.tier == "cpu"} == {alice.fingerprint_hex}


async def test_a_tenant_under_its_quota_keeps_its_chunks_through_another_tenants_scan() -> None:
    quota = NamespacePolicyConfig(quota_chunks={"cpu": 3}, write_policy=WritePolicy.WRITE_BACK)
    cfg = TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=CHUNK * 8), default_policy=quota)
    async with TieredKV(cfg, tiers=NullTiers()) as kv:
        await kv.register(NS, gpu_tensors())
        gold, scanner = make_namespace(cache_salt="gold"), make_namespace(cache_salt="scanner")
        gold_keys = chunk_keys(gold, list(range(48)))
        await kv.store(gold, request_id="g", keys=[gold_keys], block_ids=[blocks_for(3)])
        await kv.finish_request("g")
        for i in range(40):  # a long one-off scan, a chunk at a time
            key = chunk_keys(scanner, list(range(i * 16, i * 16 + 16)), group=0)
            result = await kv.store(scanner, request_id=f"s{i}", keys=[key], block_ids=[blocks_for(1, 100)])
            assert not result.rejected
            await kv.finish_request(f"s{i}")
        assert kv.lookup(gold, [gold_keys]) == 3
        kv.check_invariants()


async def test_a_quota_that_no_longer_fits_is_dropped_with_a_warning() -> None:
    quota = NamespacePolicyConfig(quota_chunks={"cpu": 5})
    cfg = TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=CHUNK * 8), default_policy=quota)
    async with TieredKV(cfg, tiers=NullTiers()) as kv:
        await kv.register(NS, gpu_tensors())  # the model's own share takes 5 of 8
        tenant = make_namespace(cache_salt="late")
        with capture_logs() as events:
            await kv.store(tenant, request_id="t", keys=[keys_for(1, ns=tenant)], block_ids=[blocks_for(1)])
        assert [e["tier"] for e in events if e["event"] == "quota.unavailable"] == ["cpu"]
        await kv.finish_request("t")
        assert kv.lookup(tenant, [keys_for(1, ns=tenant)]) == 1


async def test_a_caller_deadline_cancels_a_load_cleanly() -> None:
    harness = await open_harness(config())
    keys = keys_for(2)
    await harness.store(keys)
    await harness.kv.finish_request("r")
    harness.gpu.gate.clear()  # the copy to the GPU never finishes in time
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await harness.load(keys)
    assert harness.kv.statistics().tiers[0].pinned_chunks == 0
    harness.kv.check_invariants()
    harness.gpu.gate.set()
    assert await harness.load(keys) == 2 * NS.geometry.chunk_size
    await harness.kv.close()


async def test_an_admission_filter_stores_a_chunk_only_once_seen_k_times() -> None:
    seen_twice = NamespacePolicyConfig(admission="seen_k", admission_k=2)
    cfg = TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=CHUNK * 8), default_policy=seen_twice)
    async with TieredKV(cfg, tiers=NullTiers()) as kv:
        await kv.register(NS, gpu_tensors())
        keys = keys_for(3)
        first = await kv.store(NS, request_id="a", keys=[keys], block_ids=[blocks_for(3)])
        assert (first.submitted, first.skipped) == (0, 3)
        await kv.finish_request("a")
        assert kv.lookup(NS, [keys]) == 0
        second = await kv.store(NS, request_id="b", keys=[keys], block_ids=[blocks_for(3)])
        assert (second.submitted, second.skipped) == (3, 0)
        await kv.finish_request("b")
        assert kv.lookup(NS, [keys]) == 3


async def test_an_unknown_admission_filter_fails_registration_by_name() -> None:
    cfg = TieredKVConfig(
        cpu=CpuTierConfig(capacity_bytes=CHUNK * 8), default_policy=NamespacePolicyConfig(admission="nope")
    )
    tiers = NullTiers()
    async with TieredKV(cfg, tiers=tiers) as kv:
        with pytest.raises(UnknownPluginError, match="seen_k"):
            await kv.register(NS, gpu_tensors())
        assert [tier._closed for tier in tiers.made["cpu"]] == [True]  # the slab it opened is closed


async def test_statistics_include_every_drivers_own_counters(h: Harness) -> None:
    await h.store(keys_for(3))
    await h.kv.finish_request("r")
    await h.kv.drain()
    drivers = {d.name: d for d in h.kv.statistics().drivers}
    assert set(drivers) == {"gpu", "cpu", "nvme"}
    assert drivers["gpu"].reads == 3 and drivers["nvme"].writes == 3


async def test_lookups_count_chunk_positions_by_the_tier_that_serves_them() -> None:
    harness = await open_harness(config(cpu_chunks=4, nvme_chunks=16))
    first = keys_for(4)
    await harness.store(first)  # fills cpu; written through to nvme
    await harness.kv.finish_request("r")
    await harness.kv.drain()
    await harness.store(keys_for(2, start=90_000), offset=100)  # LRU: pushes first[0:2] out of cpu
    await harness.kv.finish_request("r")
    await harness.kv.drain()
    assert harness.lookup([*first, *keys_for(2, start=50_000)]) == 4
    assert harness.kv.statistics().lookups == {"hit_cpu": 2, "hit_nvme": 2, "miss": 2}
    await harness.kv.close()


async def test_load_latency_histogram_counts_every_timed_load(h: Harness) -> None:
    keys = keys_for(2)
    await h.store(keys)
    await h.kv.finish_request("r")
    for _ in range(3):
        assert await h.load(keys) == 2 * NS.geometry.chunk_size
    latency = h.kv.statistics().load_latency
    assert latency.count == sum(latency.counts) == 3
    assert len(latency.counts) == len(latency.bounds_ms) + 1
    assert latency.sum_ms > 0


async def test_statistics_give_each_tenants_share_of_each_tier(h: Harness) -> None:
    tenant = msgspec.structs.replace(NS, lora_id="adapter-a")
    await h.store(keys_for(2))
    await h.kv.store(tenant, request_id="t", keys=[keys_for(3, ns=tenant)], block_ids=[blocks_for(3, 50)])
    await h.kv.finish_request("r")
    await h.kv.finish_request("t")
    shares = {(s.namespace, s.tier): s.used_chunks for s in h.kv.statistics().namespaces}
    assert shares[(NS.fingerprint_hex, "cpu")] == 2
    assert shares[(tenant.fingerprint_hex, "cpu")] == 3
    assert {s.model_id for s in h.kv.statistics().namespaces} == {NS.model_id}


async def test_a_new_tenants_first_store_reads_no_installed_distributions(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant's first store builds its policies on the event loop: reading the
    installed distributions' entry points there cost milliseconds per tier (issue 10)."""
    import tiered_kv.registry as registry_module

    async with TieredKV(config(nvme_chunks=None), tiers=NullTiers()) as kv:
        await kv.register(NS, gpu_tensors())  # the policy and drivers' plug-ins are loaded now
        reads = []
        real = registry_module.entry_points
        monkeypatch.setattr(registry_module, "entry_points", lambda **kw: reads.append(kw) or real(**kw))
        for salt in ("alice", "bob"):
            tenant = make_namespace(cache_salt=salt)
            await kv.store(tenant, request_id=salt, keys=[keys_for(1, ns=tenant)], block_ids=[blocks_for(1)])
            await kv.finish_request(salt)
            assert kv.lookup(tenant, [keys_for(1, ns=tenant)]) == 1
        assert reads == []

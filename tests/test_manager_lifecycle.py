"""TieredKV at the edges of its lifecycle: close while work waits, failed registration,
tenants coming and going, a multi-group store that is rejected."""

from __future__ import annotations

import asyncio
import itertools
import random
import time

import msgspec
import pytest
import torch
from conftest import make_namespace, mla_geometry
from test_manager_control import CHUNK, NS, K, blocks_for, config, gpu_tensors, keys_for, open_harness, settle

from tiered_kv import (
    CpuTierConfig,
    KVGeometry,
    KVGroup,
    Namespace,
    NamespacePolicyConfig,
    NvmeTierConfig,
    TieredKV,
    TieredKVConfig,
    TieredKVError,
    chunk_keys,
    release,
)
from tiered_kv.errors import ConfigError, TierClosedError, TierError, TierIOError
from tiered_kv.manager import _StoreJob
from tiered_kv.null import NullTier, NullTiers
from tiered_kv.stats import KVEventKind

#: A model with two full-attention KV groups of one layer each.
TWO_GROUPS = make_namespace(
    geometry=KVGeometry(
        dtype="float16",
        block_size=4,
        chunk_size=16,
        groups=(KVGroup(num_layers=1, num_kv_heads=1, head_dim=8), KVGroup(num_layers=1, num_kv_heads=1, head_dim=8)),
    )
)
#: Bytes of one token chunk over both groups.
TWO_GROUPS_CHUNK = TWO_GROUPS.geometry.chunk_bytes(0) + TWO_GROUPS.geometry.chunk_bytes(1)


class LoopTurns:
    """How often a task of its own got the loop, sleeping ``period`` s at a time, while
    the ``with`` body ran: whether a step gave the loop back."""

    def __init__(self, period: float) -> None:
        self.period = period
        self.count = 0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            self.count += 1

    def __enter__(self) -> LoopTurns:
        self._task = asyncio.ensure_future(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


async def test_flush_from_a_tenant_waits_for_stores_reading_those_blocks() -> None:
    harness = await open_harness(config())
    tenant = make_namespace(cache_salt="tenant")
    harness.gpu.gate.clear()
    await harness.kv.store(tenant, request_id="t", keys=[keys_for(1, ns=tenant)], block_ids=[blocks_for(1)])
    assert not harness.kv.flush_nowait([0], namespace=tenant)
    flushed = asyncio.ensure_future(harness.kv.flush([0], namespace=tenant))
    await settle()
    assert not flushed.done()
    harness.gpu.gate.set()
    await flushed
    await harness.kv.close()


async def test_a_store_jobs_release_reaches_a_waiter_that_asks_before_or_after_it() -> None:
    """The future is made when first asked for: after the release it is made resolved
    (a flush between a copy's end and its task's clean-up must not wait forever)."""
    harness = await open_harness(config())
    harness.gpu.gate.clear()
    await harness.store(keys_for(2), request_id="r")
    (job,) = harness.kv._jobs["r"]
    asked_first, released_first = (_StoreJob(job.group, job.namespace, name) for name in ("a", "b"))
    waiter = asked_first.gpu_released
    assert not waiter.done()
    asked_first.release_gpu()
    assert waiter.done() and asked_first.gpu_released is waiter
    released_first.release_gpu()
    assert released_first.gpu_released.done()
    assert not job.gpu_released.done()  # the real job's copy still waits
    harness.gpu.gate.set()
    await harness.kv.finish_request("r")
    await harness.kv.close()


async def test_asking_whether_blocks_are_read_makes_no_future_and_answers_off_the_loop_too() -> None:
    """``flush_nowait`` and ``finish_request_nowait`` only look (a review found them making
    each job's future, which raised in a thread without a loop)."""
    harness = await open_harness(config())
    harness.gpu.gate.clear()
    await harness.store(keys_for(2), request_id="r")
    (job,) = harness.kv._jobs["r"]
    assert await asyncio.to_thread(harness.kv.flush_nowait) is False
    assert not harness.kv.flush_nowait([0]) and not harness.kv.finish_request_nowait("r")
    assert job._waiter is None
    harness.gpu.gate.set()
    await harness.kv.finish_request("r")
    assert harness.kv.flush_nowait() and harness.kv.finish_request_nowait("r")
    await harness.kv.close()


async def test_close_right_after_a_store_releases_its_job_before_its_task_ran() -> None:
    harness = await open_harness(config())
    harness.gpu.gate.clear()
    await harness.store(keys_for(2), request_id="early")  # its copy waits; the task going on with it has not run
    await harness.kv.close(drain=False)
    # finish_request must not hang on a job whose task never ran.
    assert harness.kv._jobs == {} and harness.kv.statistics().queue_depths["stores"] == 0
    harness.kv.check_invariants()
    assert harness.kv.statistics().tiers[0].used_chunks == 0


async def test_a_closing_manager_lets_go_of_its_indexes_a_step_at_a_time_and_reports_what_it_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Freeing a million keys in one go held the loop 10-23 ms at close (tiered_kv/release.py)."""
    monkeypatch.setattr(release, "STEP", 8)
    harness = await open_harness(config(cpu_chunks=64, nvme_chunks=128))
    for prompt in range(12):  # prompts of 4 chunks: prefix links too
        await harness.store(keys_for(4, start=prompt * 1000), request_id=f"p{prompt}", offset=4 * K * (prompt % 4))
        await harness.kv.finish_request(f"p{prompt}")
    await harness.kv.drain()
    (pool,) = harness.kv._control.pools.values()
    tables = [pool.cpu._slots, pool.nvme._slots]  # type: ignore[union-attr]
    assert [len(table) for table in tables] == [48, 48]
    with LoopTurns(0) as turns:
        await harness.kv.close()
    assert [len(table) for table in tables] == [0, 0] and not harness.kv._control.pools
    assert turns.count >= 4 * 48 // 8  # two indexes and their policies, 8 keys a step
    stats = harness.kv.statistics()
    assert [tier.used_chunks for tier in stats.tiers] == [48, 48]  # what it held at close


async def test_a_closing_index_empties_its_map_of_chunks_counted_in_another_share_in_steps_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past ``max_tenants`` a tenant's chunks count in another share, which the index
    remembers per slot: a map that grows with the tier, let go of a step at a time."""
    monkeypatch.setattr(release, "STEP", 2)
    harness = await open_harness(config(cpu_chunks=64, nvme_chunks=128), max_tenants=1)
    for t in range(4):
        tenant = msgspec.structs.replace(NS, cache_salt=f"t{t}")
        keys = keys_for(4, start=t * 100, ns=tenant)
        await harness.kv.store(tenant, request_id=f"t{t}", keys=[keys], block_ids=[blocks_for(4, 4 * K * t)])
        await harness.kv.finish_request(f"t{t}")
    await harness.kv.drain()
    (pool,) = harness.kv._control.pools.values()
    maps = [pool.cpu._other_owner, pool.nvme._other_owner]  # type: ignore[union-attr]
    assert [len(m) for m in maps] == [16, 16]
    seen: set[int] = set()

    async def watch() -> None:
        while True:
            seen.update(len(m) for m in maps)
            await asyncio.sleep(0)

    watcher = asyncio.ensure_future(watch())
    await harness.kv.close()
    watcher.cancel()
    assert maps == [{}, {}]
    assert seen & set(range(1, 16)), f"emptied in one step: sizes seen {sorted(seen)}"


@pytest.mark.parametrize("seed", range(12))
async def test_a_closing_manager_lets_go_of_no_map_of_its_indexes_in_one_step_after_random_churn(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the policy and traffic left in the maps a closing manager lets go of in
    Python (parked keys, chunks counted in another share), each shrinks by at most a step
    per turn of the loop. The parked keys of a churned prefix tree were freed at once (a
    million: 40 ms) while the tables beside them went a step at a time."""
    rng = random.Random(seed)
    step = rng.choice([1, 2])
    monkeypatch.setattr(release, "STEP", step)
    policy = rng.choice(["lru", "arc", "s3fifo"])
    cfg = config(cpu_chunks=16, nvme_chunks=32)
    cfg = msgspec.structs.replace(cfg, default_policy=msgspec.structs.replace(cfg.default_policy, policy=policy))
    harness = await open_harness(cfg)
    # Conversations growing a turn at a time: an old turn's chunks continue in newer ones,
    # so evictions walk past them and park them (multi-turn chat's prefix trees).
    chats = [keys_for(12, start=c * 1000) for c in range(8)]
    turns = [0] * len(chats)
    for i in range(80):
        c = rng.randrange(len(chats))
        if rng.random() < 0.3:
            hits = harness.lookup(chats[c]) // NS.geometry.chunk_size
            await harness.load(chats[c][:hits], request_id=f"l{i}")
        turns[c] = min(12, turns[c] + rng.randint(1, 3))
        await harness.store(chats[c][: turns[c]], request_id=f"s{i}", offset=4 * K * (i % 4))
        await harness.kv.finish_request(f"s{i}")
        await harness.kv.drain()  # on nvme before the next turn: cpu has room for it
    maps: list[dict[object, object]] = []
    for pool in harness.kv._control.pools.values():
        for index in (pool.cpu, pool.nvme):
            assert index is not None
            maps.append(index._other_owner)
            maps += [share.policy._links._parked for share in index._partition._shares.values()]
    sizes = [[len(m)] for m in maps]
    assert sum(size for [size] in sizes) > step, "nothing parked: the traffic tests nothing"

    async def watch() -> None:
        while True:
            await asyncio.sleep(0)
            for seen, m in zip(sizes, maps, strict=True):
                if len(m) != seen[-1]:
                    seen.append(len(m))

    watcher = asyncio.ensure_future(watch())
    await harness.kv.close()
    watcher.cancel()
    for seen, m in zip(sizes, maps, strict=True):
        assert not m
        drops = [a - b for a, b in itertools.pairwise([*seen, 0])]
        assert max(drops, default=0) <= step, f"{policy}: sizes seen in turn {seen}"


async def test_a_load_in_flight_when_the_manager_closes_still_ends_as_it_would_have() -> None:
    """Its chunks stay pinned in the index until it ends: the index is not let go of
    meanwhile (a review found the load's unpin failing on an index emptied at close)."""
    harness = await open_harness(config(cpu_chunks=64, nvme_chunks=128))
    keys = keys_for(4)
    await harness.store(keys, request_id="s")
    await harness.kv.finish_request("s")
    await harness.kv.drain()
    (pool,) = harness.kv._control.pools.values()
    harness.gpu.gate.clear()  # the load's cpu -> gpu copy waits
    load = asyncio.ensure_future(harness.load(keys))
    await settle()
    await harness.kv.close(drain=False)
    harness.gpu.gate.set()
    assert await load == 4 * NS.geometry.chunk_size
    assert len(pool.cpu._slots) == 4  # left to be freed with the manager


@pytest.mark.parametrize("seed", range(30))
async def test_close_at_a_random_moment_of_random_traffic_ends_every_call_cleanly(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stores, loads, lookups and flushes in flight, copies held up and let go at random,
    and a close (drained or not) at a random moment, while the indexes are let go of in
    small steps: every call ends with its result or a typed error, none hangs, and the
    closed manager reports and lets go of what it held."""
    rng = random.Random(seed)
    monkeypatch.setattr(release, "STEP", rng.choice([1, 3, 64]))
    harness = await open_harness(config(cpu_chunks=32, nvme_chunks=64))
    prompts = [keys_for(4, start=p * 1000) for p in range(8)]
    for p in range(4):  # some to load from the start
        await harness.store(prompts[p], request_id=f"warm{p}", offset=4 * K * p)
        await harness.kv.finish_request(f"warm{p}")
    await harness.kv.drain()

    async def call(i: int) -> None:
        await asyncio.sleep(rng.uniform(0, 0.002))
        keys = rng.choice(prompts)
        kind = rng.choice(["store", "load", "lookup", "flush"])
        try:
            if kind == "store":
                await harness.store(keys, request_id=f"s{i}", offset=4 * K * (i % 8))
                await harness.kv.finish_request(f"s{i}")
            elif kind == "load":
                await harness.load(keys, request_id=f"l{i}")
            elif kind == "lookup":
                harness.lookup(keys)
            else:
                await harness.kv.flush()
        except TieredKVError as exc:  # closed meanwhile: nothing else
            assert "closed" in str(exc), f"{kind}: {exc!r}"

    async def gates() -> None:
        for _ in range(20):
            tier = rng.choice([harness.gpu, harness.nvme])
            tier.gate.clear() if rng.random() < 0.5 else tier.gate.set()
            await asyncio.sleep(rng.uniform(0, 0.001))
        harness.gpu.gate.set()
        harness.nvme.gate.set()

    calls = [asyncio.ensure_future(call(i)) for i in range(40)]
    opener = asyncio.ensure_future(gates())
    await asyncio.sleep(rng.uniform(0, 0.003))
    closing = asyncio.ensure_future(harness.kv.close(drain=rng.random() < 0.5))
    await asyncio.wait_for(asyncio.gather(*calls, opener, closing), 10)
    stats = harness.kv.statistics()
    assert all(tier.used_chunks <= tier.capacity_chunks for tier in stats.tiers)


async def test_an_error_after_the_drivers_closed_is_raised_by_close() -> None:
    """A driver's statistics (taken at close) or a policy's clear failing is a bug that
    close reports, not one the shutdown task keeps to itself."""

    class Failing(NullTiers):
        def cpu(self, namespace: Namespace, group: int, slot_bytes: int, num_slots: int) -> NullTier:
            tier = super().cpu(namespace, group, slot_bytes, num_slots)

            def statistics() -> object:
                if tier._closed:
                    raise RuntimeError("no statistics once closed")
                return NullTier.statistics(tier)

            tier.statistics = statistics  # type: ignore[method-assign]
            return tier

    kv = TieredKV(config(), tiers=Failing())
    await kv.register(NS, gpu_tensors())
    with pytest.raises(RuntimeError, match="once closed"):
        await kv.close()


async def test_a_store_waiting_for_room_when_the_manager_closes_fails_cleanly() -> None:
    harness = await open_harness(config(cpu_chunks=64), max_store_chunks=2)
    harness.gpu.gate.clear()
    await harness.store(keys_for(2), request_id="full")
    waiting = asyncio.ensure_future(harness.store(keys_for(1, start=9_000), request_id="late", offset=40))
    await settle()
    await harness.kv.close(drain=False)
    with pytest.raises(TieredKVError, match="closed"):
        await waiting
    stats = harness.kv.statistics()
    assert stats.queue_depths["stores"] == 0 and stats.tiers[0].used_chunks == 0
    harness.kv.check_invariants()


class FailingNvme(NullTiers):
    """Opening the nvme store fails the first ``failures`` times."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def nvme(self, namespace: Namespace, group: int, slot_bytes: int, num_slots: int, cfg: object) -> NullTier:
        if self.failures:
            self.failures -= 1
            raise TierIOError("disk missing", tier="nvme")
        return await super().nvme(namespace, group, slot_bytes, num_slots, cfg)  # type: ignore[arg-type]


async def test_a_failed_registration_leaves_nothing_behind_and_can_be_retried() -> None:
    two_groups = TWO_GROUPS
    chunk = TWO_GROUPS_CHUNK
    cfg = TieredKVConfig(
        cpu=CpuTierConfig(capacity_bytes=chunk * 4), nvme=NvmeTierConfig(root="/unused", capacity_bytes=chunk * 8)
    )
    tiers = FailingNvme(failures=1)
    async with TieredKV(cfg, tiers=tiers) as kv:
        with pytest.raises(TierIOError):
            await kv.register(two_groups, [gpu_tensors()[0], gpu_tensors()[0]])
        assert kv._control.pools == {}
        closed = [tier for tier in tiers.made["cpu"] if tier._closed]
        assert len(closed) == len(tiers.made["cpu"]) == 1  # the slab built before the failure was closed
        await kv.register(two_groups, [gpu_tensors()[0], gpu_tensors()[0]])  # the budget is still there
        assert kv.statistics().tiers[0].capacity_chunks == 2 * 4


class SlowNvme(NullTiers):
    """Opening the nvme store takes a trip through the event loop, as a real one does."""

    async def nvme(self, namespace: Namespace, group: int, slot_bytes: int, num_slots: int, cfg: object) -> NullTier:
        await asyncio.sleep(0)
        return await super().nvme(namespace, group, slot_bytes, num_slots, cfg)  # type: ignore[arg-type]


async def test_replicated_ranks_registering_at_once_share_one_set_of_pools() -> None:
    tiers = SlowNvme()
    ranks = [make_namespace(geometry=mla_geometry(), tp_size=2, tp_rank=r) for r in range(2)]
    chunk = ranks[0].geometry.chunk_bytes()
    cfg = TieredKVConfig(
        cpu=CpuTierConfig(capacity_bytes=chunk * 4), nvme=NvmeTierConfig(root="/unused", capacity_bytes=chunk * 4)
    )
    async with TieredKV(cfg, tiers=tiers) as kv:
        await asyncio.gather(*(kv.register(ns, gpu_tensors()) for ns in ranks))
        assert len(tiers.made["cpu"]) == 1 and len(tiers.made["gpu"]) == 2


async def test_a_load_waiting_on_a_promotion_that_close_cancels_is_a_miss() -> None:
    harness = await open_harness(config(cpu_chunks=1, nvme_chunks=4))
    keys = keys_for(1)
    await harness.store(keys)
    await harness.kv.drain()
    await harness.store(keys_for(1, start=70_000), offset=100)
    await harness.kv.drain()
    harness.nvme.gate.clear()
    load = asyncio.ensure_future(harness.load(keys))
    await settle()
    await harness.kv._scheduler.close()  # what close(drain=False) does to background copies
    assert await load == 0
    harness.kv.check_invariants()
    await harness.kv.close(drain=False)


async def test_idle_tenants_give_their_shares_back_past_the_bound() -> None:
    tiers = NullTiers()
    async with TieredKV(config(cpu_chunks=2, nvme_chunks=None), tiers=tiers, max_tenants=3) as kv:
        await kv.register(NS, gpu_tensors())
        for i in range(12):
            tenant = make_namespace(cache_salt=f"user-{i}")
            result = await kv.store(
                tenant, request_id=f"r{i}", keys=[keys_for(1, ns=tenant)], block_ids=[blocks_for(1)]
            )
            assert not result.rejected
            await kv.finish_request(f"r{i}")
            (pool,) = kv._control.pools.values()
            # At most max_tenants shares, plus the one overflow share of the tenants past it.
            assert len(pool.owners) <= 3 and len(pool.cpu.partition.namespaces()) <= 3 + 1
            kv.check_invariants()
        latest = make_namespace(cache_salt="user-11")
        assert kv.lookup(latest, [keys_for(1, ns=latest)]) == 1


async def test_a_rejected_multi_group_store_changes_nothing_in_any_group() -> None:
    two_groups = TWO_GROUPS
    chunk = TWO_GROUPS_CHUNK
    tiers = NullTiers()
    async with TieredKV(TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=chunk * 2)), tiers=tiers) as kv:
        await kv.register(two_groups, [gpu_tensors()[0], gpu_tensors()[0]])
        table = blocks_for(2)
        old = [chunk_keys(two_groups, list(range(32)), group=g) for g in range(2)]
        await kv.store(two_groups, request_id="old", keys=old, block_ids=[table, table])
        await kv.finish_request("old")
        tiers.made["gpu"][1].gate.clear()  # group 1's next chunks stay PENDING: unevictable
        pending = chunk_keys(two_groups, list(range(500, 532)), group=1)
        await kv.store(two_groups, request_id="pending", keys=[[], pending], block_ids=[[], table])
        kv.drain_events()
        new = [chunk_keys(two_groups, list(range(900, 916)), group=g) for g in range(2)]
        result = await kv.store(two_groups, request_id="new", keys=new, block_ids=[table, table])
        assert result.rejected
        group0 = kv._control.pools[(two_groups.fingerprint_hex, 0)]
        assert all(group0.cpu.is_ready(key) for key in old[0])  # group 0 kept its chunks
        assert not [e for e in kv.drain_events() if e.kind is KVEventKind.REMOVED]
        kv.check_invariants()
        tiers.made["gpu"][1].gate.set()
        assert CHUNK > 0


class FailingClose(NullTiers):
    """Drivers whose ``close`` fails for the tiers named in ``fail``; each close is counted."""

    def __init__(self, fail: set[str]) -> None:
        super().__init__()
        self.fail = fail

    def _make(self, name: str, slot_bytes: int, num_slots: int) -> NullTier:
        tier = super()._make(name, slot_bytes, num_slots)
        inner_close = tier.close

        async def close() -> None:
            await inner_close()
            await asyncio.sleep(0)  # a real driver waits for its threads
            if name in self.fail:
                raise TierIOError("close failed", tier=name)

        tier.close = close  # type: ignore[method-assign]
        return tier


async def test_close_closes_every_driver_even_when_one_fails_then_raises() -> None:
    # Regression (issue 9.6): close() stopped at the first driver that failed to close.
    tiers = FailingClose(fail={"gpu"})
    kv = TieredKV(config(), tiers=tiers)
    await kv.register(NS, gpu_tensors())
    with pytest.raises(TierIOError, match="close failed"):
        await kv.close()
    assert all(tier._closed for made in tiers.made.values() for tier in made)


class RecordedClose(NullTiers):
    """Drivers that note, in one list, the order in which they close."""

    def __init__(self) -> None:
        super().__init__()
        self.closed: list[str] = []

    def _make(self, name: str, slot_bytes: int, num_slots: int) -> NullTier:
        tier = super()._make(name, slot_bytes, num_slots)
        inner_close = tier.close

        async def close() -> None:
            self.closed.append(name)
            await inner_close()

        tier.close = close  # type: ignore[method-assign]
        return tier


async def test_the_cpu_tier_closes_after_every_driver_that_copies_through_its_slots() -> None:
    """Its close gives its slab's pages back (they read zeros after): the nvme and remote
    drivers read and write its slots, so they close first."""
    tiers = RecordedClose()
    kv = TieredKV(config(), tiers=tiers)
    await kv.register(NS, gpu_tensors())
    await kv.close()
    assert tiers.closed == ["gpu", "nvme", "cpu"]


async def test_a_cpu_tier_that_refuses_its_views_makes_a_load_a_miss_not_an_error() -> None:
    """Regression (review): the cpu tier refuses views once it closes, and a load that
    built its views outside the try that turns a tier's error into a miss raised it to
    the caller when the manager closed under it."""
    tiers = NullTiers()
    kv = TieredKV(config(nvme_chunks=None), tiers=tiers)
    await kv.register(NS, gpu_tensors())
    keys, tokens = keys_for(2), 2 * NS.geometry.chunk_size
    await kv.store(NS, request_id="s", keys=[keys], block_ids=[blocks_for(2)])
    await kv.finish_request("s")
    cpu = tiers.made["cpu"][0]
    view = cpu.view

    def refused(slot: int) -> torch.Tensor:
        raise TierClosedError("used after close", tier="cpu")

    cpu.view = refused  # type: ignore[method-assign]
    assert await kv.load(NS, request_id="l", keys=[keys], block_ids=[blocks_for(2, 16)], num_tokens=tokens) == 0
    cpu.view = view  # type: ignore[method-assign]
    kv.check_invariants()  # nothing left pinned
    assert await kv.load(NS, request_id="m", keys=[keys], block_ids=[blocks_for(2, 16)], num_tokens=tokens) == tokens
    await kv.close()


async def test_a_deadline_on_close_does_not_leave_drivers_open() -> None:
    tiers = FailingClose(fail=set())
    kv = TieredKV(config(), tiers=tiers)
    await kv.register(NS, gpu_tensors())
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0):
            await kv.close()
    for _ in range(10):
        await asyncio.sleep(0)
    assert all(tier._closed for made in tiers.made.values() for tier in made)


class BlockingClose(NullTiers):
    """Drivers whose ``close`` waits until ``release`` is set (a driver waiting for its disk)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    def _make(self, name: str, slot_bytes: int, num_slots: int) -> NullTier:
        tier = super()._make(name, slot_bytes, num_slots)
        inner_close = tier.close

        async def close() -> None:
            await self.release.wait()
            await inner_close()

        tier.close = close  # type: ignore[method-assign]
        return tier


async def test_a_deadline_while_close_drains_leaves_the_drivers_closing_and_returns() -> None:
    """A deadline that fires while close drains background copies: close then waited for
    every driver to close (here: for ever), although it leaves the shutdown running."""
    tiers = BlockingClose()
    kv = TieredKV(config(), tiers=tiers)
    await kv.register(NS, gpu_tensors())
    kv._scheduler.spawn(asyncio.sleep(3600), name="copy")  # a background copy to drain
    async with asyncio.timeout(30):
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await kv.close()
    assert not any(tier._closed for made in tiers.made.values() for tier in made), "still closing"
    tiers.release.set()
    async with asyncio.timeout(30):
        await kv.close()  # the second close waits for the first one's end
    assert all(tier._closed for made in tiers.made.values() for tier in made)


async def test_a_shutdown_that_fails_of_an_error_of_its_own_is_raised_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not started again for ever: close restarted a shutdown that ended by an exception."""
    calls = 0

    def broken(self: TieredKV) -> list[object]:
        nonlocal calls
        calls += 1
        raise RuntimeError("a bug in the shutdown")

    kv = TieredKV(config(), tiers=NullTiers())
    await kv.register(NS, gpu_tensors())
    monkeypatch.setattr(TieredKV, "_all_drivers", broken)
    with pytest.raises(RuntimeError, match="a bug in the shutdown"):
        async with asyncio.timeout(30):
            await kv.close()
    assert calls == 1


@pytest.mark.parametrize(
    "argument", ["max_store_chunks", "max_write_behind_chunks", "copy_concurrency", "max_events", "max_tenants"]
)
@pytest.mark.parametrize("value", [0, -1, 1.5, None, True])
def test_a_bound_that_is_not_a_positive_integer_is_a_config_error(argument: str, value: object) -> None:
    # Regression (issue 9.6): max_tenants=0 was accepted, then every store raised PolicyError;
    # the others raised a plain ValueError.
    with pytest.raises(ConfigError, match=argument):
        TieredKV(config(), tiers=NullTiers(), **{argument: value})  # type: ignore[arg-type]


async def test_a_cpu_tier_larger_than_memory_is_a_typed_error_and_leaves_the_budget() -> None:
    # Regression (issue 9.6): torch's allocator RuntimeError escaped from register.
    huge = TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=1 << 60))
    async with TieredKV(huge) as kv:
        with pytest.raises(TierError, match="cannot allocate"):
            await kv.register(NS, gpu_tensors())
        assert kv._control.pools == {}


class _SlowSlabTiers(NullTiers):
    """Null drivers whose cpu slab takes a while to make, as page-locking gigabytes does."""

    def __init__(self, delay_s: float = 0.3) -> None:
        super().__init__()
        self.delay_s = delay_s

    def cpu(self, namespace: Namespace, group: int, slot_bytes: int, num_slots: int) -> NullTier:
        time.sleep(self.delay_s)
        return super().cpu(namespace, group, slot_bytes, num_slots)


async def test_register_makes_the_cpu_slab_off_the_event_loop() -> None:
    """Allocating (with CUDA: page-locking) the cpu slab is proportional to the tier: the
    loop keeps running other tasks meanwhile (DESIGN invariant 8)."""
    async with TieredKV(config(nvme_chunks=None), tiers=_SlowSlabTiers()) as kv:
        with LoopTurns(0.01) as ticks:
            await asyncio.sleep(0)
            await kv.register(NS, gpu_tensors())
        assert ticks.count >= 5, f"the loop ran {ticks.count} times in the 0.3 s the slab took"


async def test_registrations_opening_pools_at_once_share_the_capacity_instead_of_each_taking_it() -> None:
    """Regression: two models registered with ``gather`` each took the whole cpu tier
    (32 chunks of 16 allocated) and left the budget negative for the next one."""
    models = [make_namespace(model_id=f"acme/m{i}") for i in range(3)]
    async with TieredKV(config(cpu_chunks=16, nvme_chunks=None), tiers=NullTiers()) as kv:
        outcomes = await asyncio.gather(*(kv.register(ns, gpu_tensors()) for ns in models[:2]), return_exceptions=True)
        assert outcomes[0] is None and isinstance(outcomes[1], ConfigError), outcomes
        assert kv.statistics().tiers[0].capacity_chunks == 16
        with pytest.raises(ConfigError):
            await kv.register(models[2], gpu_tensors())


@pytest.mark.parametrize("seed", range(8))
async def test_concurrent_registrations_with_deadlines_never_hand_out_more_than_the_tiers(seed: int) -> None:
    """Many models registered at once, some with a budget of their own, some cancelled by
    a deadline and retried: the pools opened never hold more than the configured tiers,
    and every refusal is a typed error."""
    rng = random.Random(seed)
    models = [make_namespace(model_id=f"acme/m{i}") for i in range(6)]
    budgets = {ns.model_id: NamespacePolicyConfig(cpu_bytes=CHUNK * rng.randint(1, 8)) for ns in models[::2]}
    cfg = msgspec.structs.replace(config(cpu_chunks=24, nvme_chunks=48), namespaces=budgets)

    async def register(ns: Namespace) -> None:
        for _ in range(3):
            try:
                async with asyncio.timeout(rng.choice([None, 0, 0.001])):
                    await kv.register(ns, gpu_tensors())
                return
            except TimeoutError:
                await asyncio.sleep(0)
            except TieredKVError:
                return

    async with TieredKV(cfg, tiers=_SlowSlabTiers(delay_s=0.002)) as kv:
        await asyncio.gather(*(register(ns) for ns in models))
        await kv.drain()
        tiers = {tier.tier: tier.capacity_chunks for tier in kv.statistics().tiers}
        assert tiers["cpu"] <= 24 and tiers.get("nvme", 0) <= 48, tiers

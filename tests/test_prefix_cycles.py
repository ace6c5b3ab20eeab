"""Predecessor links never close a cycle, whatever fails and in whatever order keys come.

A chunk is evictable once no resident chunk continues it, so a cycle of links is never
evictable: before the fix, a tenant whose copy failed (its chunk dropped while a
successor stayed) and who then stored the two keys the other way round locked two cpu
slots for good, and a few rounds of it shut every tenant's stores out of the tier.
"""

from __future__ import annotations

import random

import msgspec
import pytest
import torch
from conftest import make_namespace

from tiered_kv import CpuTierConfig, NamespacePolicyConfig, TieredKVConfig, chunk_keys
from tiered_kv.manager import TieredKV
from tiered_kv.null import NullTier, NullTiers

NS = make_namespace()
EVIL = msgspec.structs.replace(NS, cache_salt="evil")
OTHER = msgspec.structs.replace(NS, cache_salt="other")
K = NS.geometry.blocks_per_chunk
POLICIES = ["lru", "arc", "s3fifo"]


def blocks(*positions: int) -> list[int]:
    return [block for c in positions for block in range(c * K, (c + 1) * K)]


def config(policy: str, cpu_chunks: int) -> TieredKVConfig:
    return TieredKVConfig(
        cpu=CpuTierConfig(capacity_bytes=NS.geometry.chunk_bytes() * cpu_chunks),
        default_policy=NamespacePolicyConfig(policy=policy),
    )


async def fill_with_another_tenant(kv: TieredKV, chunks: int) -> int:
    """Store ``chunks`` one-chunk prompts of a tenant that needs every slot in turn; how many were taken."""
    stored = 0
    for i in range(chunks):
        start = 10**6 + i * NS.geometry.chunk_size
        keys = chunk_keys(OTHER, list(range(start, start + NS.geometry.chunk_size)))
        result = await kv.store(OTHER, request_id=f"other-{i}", keys=[keys], block_ids=[blocks(0)])
        await kv.finish_request(f"other-{i}")
        stored += result.submitted
    await kv.drain()
    return stored


@pytest.mark.parametrize("policy", POLICIES)
async def test_a_dropped_predecessor_stored_again_after_its_successor_does_not_lock_the_tier(policy: str) -> None:
    tiers = NullTiers()
    async with TieredKV(config(policy, cpu_chunks=4), tiers=tiers) as kv:
        await kv.register(NS, [[torch.zeros(256, 1)]])
        gpu: NullTier = tiers.made["gpu"][0]
        for round_ in range(2):
            a, c = chunk_keys(EVIL, list(range(1000 * round_, 1000 * round_ + 2 * NS.geometry.chunk_size)))
            gpu.gate.clear()
            gpu.fail_keys = {a}
            await kv.store(EVIL, request_id=f"a-{round_}", keys=[[a]], block_ids=[blocks(0)])  # a PENDING
            await kv.store(EVIL, request_id=f"ac-{round_}", keys=[[a, c]], block_ids=[blocks(0, 1)])  # c continues a
            gpu.gate.set()
            await kv.drain()  # a's copy failed: a is dropped, c stays
            gpu.fail_keys = set()
            await kv.store(EVIL, request_id=f"ca-{round_}", keys=[[c, a]], block_ids=[blocks(1, 0)])  # a after c
            await kv.drain()
            kv.check_invariants()
        assert await fill_with_another_tenant(kv, 4) == 4
        kv.check_invariants()


@pytest.mark.parametrize("seed", range(24))
async def test_random_failures_and_key_orders_leave_every_chunk_evictable(seed: int) -> None:
    """Prompts over a small pool of keys, in random orders and overlaps, stored while
    earlier copies wait, with copies that fail at random while others continue them:
    the links stay acyclic (checked after every step), and another tenant can still
    take the whole tier."""
    rng = random.Random(seed)
    policy = POLICIES[seed % len(POLICIES)]
    cpu_chunks = rng.randint(3, 5)
    tiers = NullTiers()
    async with TieredKV(config(policy, cpu_chunks), tiers=tiers) as kv:
        await kv.register(NS, [[torch.zeros(256, 1)]])
        gpu: NullTier = tiers.made["gpu"][0]
        pool = chunk_keys(EVIL, list(range(8 * NS.geometry.chunk_size)))  # more than fit: evictions
        gpu.gate.clear()  # copies wait: the next stores see these chunks PENDING
        for step in range(500):
            n = rng.randint(2, 3)
            keys = rng.sample(pool, n)
            await kv.store(EVIL, request_id=f"s{step}", keys=[keys], block_ids=[blocks(*range(n))])
            if rng.random() < 0.5:  # the copies waiting so far end, those of one key failed
                gpu.fail_keys = set(rng.sample(pool, 1))
                gpu.gate.set()
                await kv.drain()
                gpu.gate.clear()
            kv.check_invariants()
        gpu.gate.set()
        gpu.fail_keys = set()
        await kv.drain()
        kv.check_invariants()
        assert await fill_with_another_tenant(kv, cpu_chunks) == cpu_chunks
        kv.check_invariants()


def test_the_index_check_finds_a_cycle_of_links() -> None:
    """check() is what the tests above rely on: a cycle planted in a policy's links is reported."""
    from tiered_kv.control import ControlPlane
    from tiered_kv.errors import TieredKVError
    from tiered_kv.telemetry import Telemetry

    control = ControlPlane(Telemetry(100), max_tenants=8)
    (pool,) = control.add_pools(NS, NamespacePolicyConfig(policy="lru"), 4, 0)
    a, c = chunk_keys(NS, list(range(2 * NS.geometry.chunk_size)))
    plan = control.plan_store(NS, [[a, c]], [blocks(0, 1)])
    for group in plan.groups:
        control.complete_store(group, ok=True)
    # What no step may do: a continues its own successor (counts kept right, so that
    # only the cycle is wrong).
    index = pool.cpu
    slot_a, slot_c = index.slot(a), index.slot(c)
    index._parent[16 * slot_a : 16 * (slot_a + 1)] = c
    index._has_parent[slot_a] = 1
    index._children[slot_c] += 1
    with pytest.raises(TieredKVError, match="cycle"):
        control.verify_invariants()

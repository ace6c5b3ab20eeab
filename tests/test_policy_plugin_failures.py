"""A policy plug-in that raises never leaves the index and the partition disagreeing.

Making room in a tier that tenants share takes victims from one share after another; a
plug-in whose ``evict`` raised half way (or whose ``insert`` raised while a failed plan
put its victims back) left chunks resident in the index that no policy held any more:
``check_invariants`` failed, and every later store that needed room raised "allocator
lost track of free slots", for every tenant (an adversarial test's finding).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import ClassVar

import msgspec
import pytest
import torch
from conftest import make_namespace

from tiered_kv import CpuTierConfig, NamespacePolicyConfig, TieredKVConfig, chunk_keys
from tiered_kv.directory import LeaseEpoch, TierIndex
from tiered_kv.interfaces import CachePolicy
from tiered_kv.keys import ChunkKey
from tiered_kv.manager import TieredKV
from tiered_kv.null import NullTiers
from tiered_kv.partition import TierPartition
from tiered_kv.policy_factory import make_policy
from tiered_kv.registry import POLICIES

NS = make_namespace()
K, CS = NS.geometry.blocks_per_chunk, NS.geometry.chunk_size


class PluginFailed(Exception):
    pass


class Raising:
    """A real policy behind a plug-in that raises, before changing anything, when told to."""

    name = "raising-lru"
    #: How many of the next calls of each kind raise.
    failures: ClassVar[dict[str, int]] = {}
    #: Raise at random instead, with this probability (``rng``).
    chance = 0.0
    rng = random.Random(0)

    def __init__(self, inner: CachePolicy) -> None:
        self.inner = inner

    def _maybe_raise(self, what: str) -> None:
        left = Raising.failures.get(what, 0)
        if left or (Raising.chance and Raising.rng.random() < Raising.chance):
            Raising.failures[what] = max(0, left - 1)
            raise PluginFailed(what)

    def __len__(self) -> int:
        return len(self.inner)

    def __contains__(self, key: object) -> bool:
        return key in self.inner

    def insert(self, key: ChunkKey, parent: ChunkKey | None = None) -> None:
        self._maybe_raise("insert")
        self.inner.insert(key, parent)

    def touch(self, key: ChunkKey) -> None:
        self._maybe_raise("touch")
        self.inner.touch(key)

    def remove(self, key: ChunkKey) -> None:
        self.inner.remove(key)

    def evict(self, n: int, protected: Callable[[ChunkKey], bool]) -> list[ChunkKey] | None:
        self._maybe_raise("evict")
        return self.inner.evict(n, protected)


@pytest.fixture(autouse=True)
def raising_plugin() -> object:
    def factory(
        capacity: int, *, clock: Callable[[], float] | None = None, rng: random.Random | None = None
    ) -> Raising:
        return Raising(make_policy("lru", capacity, rng=rng))

    POLICIES.register("raising-lru", factory)
    Raising.failures, Raising.chance = {}, 0.0
    yield
    POLICIES.unregister("raising-lru")


def blocks(*positions: int) -> list[int]:
    return [block for c in positions for block in range(c * K, (c + 1) * K)]


@pytest.mark.parametrize("what", ["evict", "insert"])
async def test_a_plugin_raising_while_room_is_made_changes_nothing_and_the_tier_stays_usable(what: str) -> None:
    a, b, c = (msgspec.structs.replace(NS, cache_salt=salt) for salt in "abc")
    quota = {"cpu": 1} if what == "insert" else {}
    config = TieredKVConfig(
        cpu=CpuTierConfig(capacity_bytes=3 * NS.geometry.chunk_bytes()),
        default_policy=NamespacePolicyConfig(policy="raising-lru", quota_chunks=quota),
    )
    tiers = NullTiers()
    async with TieredKV(config, tiers=tiers) as kv:
        await kv.register(NS, [[torch.zeros(128, 1)]])
        a_keys, b_keys = chunk_keys(a, list(range(2 * CS))), chunk_keys(b, list(range(3 * CS)))
        for i, key in enumerate(a_keys):
            await kv.store(a, request_id=f"a{i}", keys=[[key]], block_ids=[blocks(i)])
        await kv.store(b, request_id="b0", keys=[[b_keys[0]]], block_ids=[blocks(2)])
        await kv.drain()
        load = None
        if what == "insert":
            # b's chunk is being loaded (pinned) while b stores two more: the plan takes one
            # of a's (above its quota), cannot take another, and puts it back through insert.
            tiers.made["gpu"][0].gate.clear()
            load = asyncio.ensure_future(
                kv.load(b, request_id="load", keys=[[b_keys[0]]], block_ids=[blocks(9)], num_tokens=CS)
            )
            await asyncio.sleep(0.01)
            Raising.failures = {"insert": 1}
        else:  # b's own victim is taken, then a's evict raises
            real_evict = Raising.evict
            calls = []

            def second_raises(self: Raising, n: int, protected: Callable[[ChunkKey], bool]) -> list[ChunkKey] | None:
                calls.append(n)
                if len(calls) == 2:
                    raise PluginFailed("evict")
                return real_evict(self, n, protected)

            Raising.evict = second_raises  # type: ignore[method-assign]
        try:
            with pytest.raises(PluginFailed):
                await kv.store(b, request_id="b12", keys=[b_keys[1:3]], block_ids=[blocks(3, 4)])
        finally:
            if what == "evict":
                Raising.evict = real_evict  # type: ignore[method-assign]
        kv.check_invariants()
        if load is not None:
            tiers.made["gpu"][0].gate.set()
            assert await load == CS
        await kv.drain()
        kv.check_invariants()
        # Another tenant stores one chunk at a time and then as many as the quotas leave it.
        c_keys = chunk_keys(c, list(range(6 * CS)))
        for i in range(3):
            result = await kv.store(c, request_id=f"c{i}", keys=[[c_keys[i]]], block_ids=[blocks(10 + i)])
            assert result.submitted == 1
            await kv.drain()
        free_to_take = 3 if not quota else 1  # a and b keep a chunk each under their quota
        wanted = c_keys[3 : 3 + free_to_take]
        result = await kv.store(
            c, request_id="c-all", keys=[wanted], block_ids=[blocks(20, 21, 22)[: free_to_take * K]]
        )
        await kv.drain()
        assert result.submitted == free_to_take and kv.lookup(c, [wanted]) == free_to_take
        kv.check_invariants()


@pytest.mark.parametrize("seed", range(8))
def test_random_plugin_failures_across_shares_keep_the_index_and_partition_in_step(seed: int) -> None:
    rng = random.Random(seed)
    owners = [f"{i}" * 64 for i in range(3)]
    partition = TierPartition("cpu", rng.randint(3, 8))
    for i, owner in enumerate(owners):
        partition.add_namespace(owner, "raising-lru", quota=i % 2)
    index = TierIndex("cpu", partition, LeaseEpoch())
    universe = [i.to_bytes(16, "little") for i in range(40)]
    Raising.rng, Raising.chance = random.Random(seed), 0.05
    for _ in range(400):
        owner = rng.choice(owners)
        wanted = [key for key in rng.sample(universe, rng.randint(1, 3)) if key not in index]
        try:
            reserved = index.reserve(wanted, owner, parents={key: rng.choice(universe) for key in wanted})
            if reserved is not None:
                index.mark_ready_many(list(reserved.slots))
            resident = [key for key in universe if key in index]
            if resident and rng.random() < 0.3:  # a load's hit, its touch perhaps raising
                pinned = rng.choice(resident)
                index.pin(pinned)
                try:
                    index.hit_many([pinned])
                finally:
                    index.unpin(pinned)
        except PluginFailed:
            pass
        index.check()
    Raising.chance = 0.0
    # Every chunk no quota keeps can be evicted: a newcomer takes all of those slots.
    kept = sum(min(partition.quota(owner), partition.usage(owner)) for owner in owners)
    newcomer = "n" * 64
    partition.add_namespace(newcomer, "lru")
    assert index.reserve([bytes([255, i]) * 8 for i in range(partition.capacity - kept)], newcomer) is not None
    index.check()

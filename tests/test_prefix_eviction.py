"""Prefix-aware eviction through the layers that own policies: the residency index, the
partition, and the manager, which names every stored chunk's predecessor."""

from __future__ import annotations

import random

import pytest
from test_manager_control import config, keys_for, open_harness

from tiered_kv import WritePolicy
from tiered_kv.directory import TierIndex
from tiered_kv.partition import TierPartition
from tiered_kv.testing import chunk_key


def index(capacity: int, policy: str = "lru") -> TierIndex:
    partition = TierPartition("cpu", capacity)
    partition.add_namespace("ns", policy)
    return TierIndex("cpu", partition)


def chain(start: int, n: int) -> tuple[list[bytes], dict[bytes, bytes | None]]:
    keys = [chunk_key(start + i) for i in range(n)]
    return keys, {key: keys[i - 1] if i else None for i, key in enumerate(keys)}


def store_ready(tier: TierIndex, keys: list[bytes], parents: dict[bytes, bytes | None]) -> list[bytes]:
    reservation = tier.reserve(keys, "ns", parents=parents)
    assert reservation is not None
    for key in keys:
        tier.mark_ready(key)
    return [victim.key for victim in reservation.evicted]


@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo"])
def test_the_index_evicts_a_stored_prompt_tail_first(policy: str) -> None:
    tier = index(8, policy)
    first, parents = chain(0, 6)
    store_ready(tier, first, parents)
    second, parents = chain(100, 4)
    evicted = store_ready(tier, second, parents)
    assert sorted(evicted) == sorted(first[4:])  # the tail: chunks 0..3 still make a prefix
    assert all(tier.is_ready(key) for key in first[:4])
    assert tier.parent(first[1]) == first[0] and tier.parent(first[0]) is None
    tier.check()


def test_a_victim_put_back_keeps_its_predecessor() -> None:
    tier = index(4)
    first, parents = chain(0, 4)
    store_ready(tier, first, parents)
    reservation = tier.reserve([chunk_key(50), chunk_key(51)], "ns")
    assert reservation is not None and [v.key for v in reservation.evicted] == first[:1:-1]
    tier.unreserve(reservation)
    assert tier.parent(first[3]) == first[2]
    again = tier.reserve([chunk_key(50)], "ns")
    assert again is not None and [v.key for v in again.evicted] == [first[3]]  # still the tail


def test_a_chunk_named_as_its_own_predecessor_starts_a_prefix_and_can_go() -> None:
    # A predecessor is recorded only if it was resident before the chunk: a self-link, or
    # links that a caller storing keys in two orders would close into a cycle, never form.
    tier = index(1)
    key = chunk_key(1)
    store_ready(tier, [key], {key: key})
    assert tier.parent(key) is None
    assert tier.reserve([chunk_key(2)], "ns") is not None  # evicts it
    tier.check()


def test_a_failed_make_room_puts_victims_back_with_their_predecessors() -> None:
    partition = TierPartition("cpu", 6)
    for name in ("a", "b", "c"):
        partition.add_namespace(name, "lru")
    a_keys, a_parents = chain(0, 3)
    b_keys, b_parents = chain(100, 3)
    for name, keys, parents in (("a", a_keys, a_parents), ("b", b_keys, b_parents)):
        for key in keys:
            partition.insert(name, key, parents[key])
    # a's chunks are all ancestors of its protected tail; b gives its three, then the plan
    # runs short and b's victims go back.
    pinned = {a_keys[-1]}
    assert partition.make_room("c", 4, pinned.__contains__, {**a_parents, **b_parents}.get) is None
    assert partition.used == 6 and partition.usage("b") == 3
    partition.touch("b", b_keys[-1])  # the most recent, but still the only leaf
    assert partition.make_room("b", 1, pinned.__contains__) == {"b": [b_keys[-1]]}


def family_prompt(rng: random.Random) -> tuple[list[bytes], dict[bytes, bytes | None]]:
    """A prompt of one of six families: three shared chunks, then one of three branches."""
    family, branch, length = rng.randrange(6), rng.randrange(3), rng.randrange(1, 9)
    keys = [chunk_key(family * 1000 + (i if i < 3 else 100 * (branch + 1) + i)) for i in range(length)]
    return keys, {key: keys[i - 1] if i else None for i, key in enumerate(keys)}


@pytest.mark.parametrize("seed", range(4))
def test_random_prompts_never_leave_a_chunk_whose_predecessor_was_evicted(seed: int) -> None:
    rng = random.Random(seed)
    tier = index(24, ["lru", "arc", "s3fifo", "lru"][seed])
    stored_with: dict[bytes, bytes | None] = {}
    for step in range(300):
        keys, parents = family_prompt(rng)
        new = [key for key in keys if key not in tier]
        if not new:
            continue
        gone = store_ready(tier, new, parents)
        for key in gone:
            del stored_with[key]
        for key in new:
            stored_with[key] = parents[key]
        for key, parent in stored_with.items():
            assert parent not in gone, f"step {step}: kept {key.hex()} but evicted its predecessor"
        tier.check()


async def test_the_manager_keeps_a_prompts_head_when_the_cpu_tier_fills() -> None:
    """Regression: LRU used to evict a stored prompt's first chunks, leaving its tail
    resident but unreachable (lookup 0)."""
    harness = await open_harness(config(cpu_chunks=8, nvme_chunks=None))
    first = keys_for(6)
    await harness.store(first)
    await harness.kv.drain()
    await harness.store(keys_for(4, start=50_000), request_id="r2", offset=100)
    await harness.kv.drain()
    assert harness.lookup(first) == 4
    harness.kv.check_invariants()
    await harness.kv.close()


async def test_write_back_spills_a_prompts_tail_to_nvme_with_its_predecessors() -> None:
    harness = await open_harness(config(cpu_chunks=4, nvme_chunks=8, write_policy=WritePolicy.WRITE_BACK))
    first = keys_for(4)
    await harness.store(first)
    await harness.kv.drain()
    await harness.store(keys_for(2, start=50_000), request_id="r2", offset=100)
    await harness.kv.drain()
    (pool,) = harness.kv._control.pools.values()
    assert pool.nvme is not None
    assert {key for key in first if key in pool.nvme} == set(first[2:])
    # Within nvme the chain holds; first[2]'s predecessor lives in cpu, not here.
    assert pool.nvme.parent(first[3]) == first[2] and pool.nvme.parent(first[2]) is None
    assert harness.lookup(first) == 4  # head from cpu, tail from nvme
    await harness.kv.close()


async def test_storing_a_prompts_tail_never_evicts_its_head() -> None:
    """Regression: the new chunks' predecessor could be the LRU victim of their own store."""
    harness = await open_harness(config(cpu_chunks=4, nvme_chunks=None))
    prompt = keys_for(4)
    other = keys_for(2, start=50_000)
    await harness.store(prompt[:2])
    await harness.kv.drain()
    await harness.store(other, request_id="r2", offset=100)
    await harness.kv.drain()
    assert await harness.load(other) == 2 * 16  # the head of ``prompt`` is now least recently used
    result = await harness.store(prompt, request_id="r3")
    await harness.kv.drain()
    assert (result.submitted, result.skipped) == (2, 2)
    assert harness.lookup(prompt) == 4 and harness.lookup(other) == 0
    await harness.kv.close()

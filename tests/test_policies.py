"""The cache policies: the shared contract, a state machine each, and what sets each apart."""

from __future__ import annotations

from unittest import mock

import pytest

from tiered_kv import release
from tiered_kv.interfaces import SteppedClearPolicy
from tiered_kv.partition import TierPartition
from tiered_kv.policies import ARC, LRU, S3FIFO
from tiered_kv.registry import POLICIES
from tiered_kv.testing import CachePolicyContract, chunk_key, policy_state_machine
from tiered_kv.testing.policies import drain, never


class TestLRU(CachePolicyContract):
    make = LRU


class TestARC(CachePolicyContract):
    make = ARC


class TestS3FIFO(CachePolicyContract):
    make = S3FIFO


class TestS3FIFOLarge(CachePolicyContract):
    """A capacity large enough that the small queue holds more than one key."""

    make = S3FIFO
    capacity = 40


TestLRUMachine = policy_state_machine(LRU).TestCase
TestARCMachine = policy_state_machine(ARC).TestCase
TestS3FIFOMachine = policy_state_machine(S3FIFO).TestCase
TestS3FIFOLargeMachine = policy_state_machine(S3FIFO, capacity=30, key_space=60, max_examples=30).TestCase


def test_every_registered_policy_is_one_of_these() -> None:
    assert POLICIES.names() == ["arc", "lru", "s3fifo"]
    assert {name: POLICIES.get(name) for name in POLICIES.names()} == {"arc": ARC, "lru": LRU, "s3fifo": S3FIFO}


def keys(*numbers: int) -> list[bytes]:
    return [chunk_key(i) for i in numbers]


# LRU


def test_lru_evicts_the_least_recently_used_first() -> None:
    lru = LRU(8)
    for key in keys(0, 1, 2, 3):
        lru.insert(key)
    lru.touch(chunk_key(0))
    lru.touch(chunk_key(2))
    assert drain(lru) == keys(1, 3, 0, 2)


def test_lru_passes_over_protected_keys_and_keeps_their_place() -> None:
    lru = LRU(8)
    for key in keys(0, 1, 2):
        lru.insert(key)
    assert lru.evict(1, {chunk_key(0)}.__contains__) == keys(1)
    assert drain(lru) == keys(0, 2)


# ARC


def test_arc_promotes_a_key_seen_twice_out_of_reach_of_a_scan() -> None:
    arc = ARC(4)
    for key in keys(0, 1):
        arc.insert(key)
        arc.touch(key)  # seen twice: T2
    for i in range(2, 40):  # a scan of keys seen once, making room as an owner does
        if len(arc) == 4:
            arc.evict(1, never)
        arc.insert(chunk_key(i))
    assert chunk_key(0) in arc and chunk_key(1) in arc


def test_arc_raises_its_recency_target_on_a_ghost_hit_in_b1_and_lowers_it_in_b2() -> None:
    arc = ARC(4)
    for key in keys(0, 1, 2, 3):
        arc.insert(key)
    arc.touch(chunk_key(3))  # T1 = 0 1 2, T2 = 3
    assert arc.target == 0
    assert arc.evict(1, never) == keys(0)  # T1 above target: T1's oldest goes to B1
    arc.insert(chunk_key(0))  # back while a ghost: recency was undervalued
    assert arc.target == 1
    # T1 = 1 2 is above target: its oldest goes to B1; then T1 is at target, so T2's oldest goes to B2.
    assert arc.evict(2, never) == keys(1, 3)
    arc.insert(chunk_key(3))  # a ghost hit in B2: frequency was undervalued
    assert arc.target == 0
    assert arc.evict(1, never) == keys(2)  # T1 is above target again
    assert drain(arc) == keys(0, 3)  # T2, oldest first


def test_arc_keeps_resident_keys_and_ghosts_within_twice_its_capacity() -> None:
    arc = ARC(10)
    for i in range(500):
        key = chunk_key(i % 37)
        if key in arc:
            arc.touch(key)
            continue
        if len(arc) == 10:
            arc.evict(1, never)
        arc.insert(key)
        t1, t2, b1, b2 = len(arc._t1), len(arc._t2), len(arc._b1), len(arc._b2)
        assert t1 + b1 <= 10 and t1 + t2 + b1 + b2 <= 20


# S3-FIFO


def fill_s3fifo(capacity: int, count: int) -> S3FIFO:
    policy = S3FIFO(capacity)
    for i in range(count):
        policy.insert(chunk_key(i))
    return policy


def test_s3fifo_one_hit_wonders_leave_from_the_small_queue_while_keys_hit_move_to_main() -> None:
    policy = fill_s3fifo(20, 10)  # small target 2
    for key in keys(0, 1, 2):
        policy.touch(key)
    assert policy.evict(5, never) == keys(3, 4, 5, 6, 7)  # 0, 1, 2 were promoted on the way
    assert all(policy.in_main(key) for key in keys(0, 1, 2))
    assert not any(policy.in_main(key) for key in keys(8, 9))


def test_s3fifo_keeps_the_small_queue_at_its_target_and_then_evicts_from_main() -> None:
    policy = fill_s3fifo(20, 4)  # small target 2
    policy.touch(chunk_key(0))
    assert policy.evict(2, never) == keys(1, 2)  # 0 promoted; small is down to 3, then 2 (its target)
    assert policy.evict(1, never) == keys(0)  # main's oldest, its hit count spent on the promotion


def test_s3fifo_a_key_evicted_from_small_is_remembered_and_returns_to_main() -> None:
    policy = fill_s3fifo(10, 2)  # small target 1
    policy.touch(chunk_key(0))
    assert policy.evict(1, never) == keys(1)  # 0 moves to main, 1 leaves small as a ghost
    assert policy.evict(1, never) == keys(0)  # from main: not remembered
    policy.insert(chunk_key(0))
    policy.insert(chunk_key(1))
    assert not policy.in_main(chunk_key(0))
    assert policy.in_main(chunk_key(1))


def test_s3fifo_main_gives_a_key_with_hits_another_round() -> None:
    policy = fill_s3fifo(10, 3)  # small target 1
    for key in keys(0, 1, 2):
        policy.touch(key)
    for key in keys(3, 4):
        policy.insert(key)  # small: 0 1 2 3 4, all but 3 and 4 hit once
    assert policy.evict(2, never) == keys(3, 4)  # 0, 1, 2 go to main; then 3, 4 leave small
    policy.touch(chunk_key(1))
    policy.touch(chunk_key(1))
    assert drain(policy) == keys(0, 2, 1)  # 1 had hits left: one more round


@pytest.mark.parametrize("maker", [LRU, ARC, S3FIFO])
def test_a_scan_does_not_grow_the_bookkeeping_beyond_the_capacity(maker: type) -> None:
    policy = maker(50)
    for i in range(5000):
        if len(policy) == 50:
            policy.evict(1, never)
        policy.insert(chunk_key(i))
    ghosts = [len(getattr(policy, name)) for name in ("_b1", "_b2", "_ghost") if hasattr(policy, name)]
    queues = [len(getattr(policy, name)) for name in ("_small", "_main") if hasattr(policy, name)]
    assert sum(ghosts) <= 100 and sum(queues) <= 50


def test_s3fifo_removals_without_evictions_do_not_grow_its_queues() -> None:
    policy = S3FIFO(100)
    for i in range(5000):
        policy.insert(chunk_key(i % 7))
        policy.remove(chunk_key(i % 7))
    assert len(policy._small) + len(policy._main) <= 2 * len(policy) + 64 + 1


def test_s3fifo_passes_over_protected_keys_and_keeps_their_place() -> None:
    policy = fill_s3fifo(10, 4)
    assert policy.evict(1, {chunk_key(0), chunk_key(1)}.__contains__) == keys(2)
    assert drain(policy) == keys(0, 1, 3)


def test_s3fifo_a_removed_key_no_longer_counts_towards_the_small_queue() -> None:
    policy = fill_s3fifo(20, 1)  # small target 2
    policy.evict(1, never)
    policy.insert(chunk_key(0))  # a ghost: into main
    for key in keys(1, 2, 3):
        policy.insert(key)
    policy.remove(chunk_key(1))
    policy.remove(chunk_key(2))
    assert policy.evict(1, never) == keys(0)  # small holds 1 < 2: main is evicted from


@pytest.mark.parametrize("maker", [LRU, ARC, S3FIFO])
def test_insert_and_touch_take_their_arguments_by_keyword_as_the_protocol_names_them(maker: type) -> None:
    """Regression (review of the C steps): ARC's insert and LRU's and ARC's touch were the
    C methods themselves, bound per instance, and refused ``parent=`` and ``key=``."""
    policy = maker(4)
    policy.insert(key=b"a")
    policy.insert(b"b", parent=b"a")
    policy.touch(key=b"a")
    assert b"a" in policy and b"b" in policy and len(policy) == 2


@pytest.mark.parametrize("maker", [LRU, ARC])
def test_a_subclass_overriding_touch_and_insert_is_called(maker: type) -> None:
    """Regression (review): the per-instance C methods shadowed a subclass's overrides (and
    a subclass with __slots__ could not be built)."""
    calls: list[str] = []

    class Counting(maker):  # type: ignore[misc, valid-type]
        __slots__ = ()

        def insert(self, key: bytes, parent: bytes | None = None) -> None:
            calls.append("insert")
            super().insert(key, parent)

        def touch(self, key: bytes) -> None:
            calls.append("touch")
            super().touch(key)

    policy = Counting(4)
    policy.insert(b"a")
    policy.touch(b"a")
    assert calls == ["insert", "touch"] and b"a" in policy
    # A residency index inserting a store's chunks goes through the override too.
    POLICIES.register("counting", Counting)
    try:
        partition = TierPartition("cpu", 4)
        partition.add_namespace("ns", "counting")
    finally:
        POLICIES.unregister("counting")
    partition.inserter("ns", 1)(b"b", None)
    assert calls[-1] == "insert"
    # And through a patch of the instance (a subclass without __slots__ takes one).

    class Plain(maker):  # type: ignore[misc, valid-type]
        pass

    POLICIES.register("plain", Plain)
    try:
        partition.add_namespace("plain", "plain")
    finally:
        POLICIES.unregister("plain")
    patched = partition.policy("plain")
    with mock.patch.object(patched, "insert", side_effect=lambda key, parent=None: calls.append("patched")):
        partition.inserter("plain", 1)(b"c", None)
        partition.insert("plain", b"d")
    assert calls[-2:] == ["patched", "patched"] and b"c" not in patched
    # Even by the same function bound to another policy: the keys go where insert sends them.
    other = Plain(4)
    with mock.patch.object(patched, "insert", other.insert):
        partition.inserter("plain", 1)(b"e", None)
    assert b"e" in other and b"e" not in patched


@pytest.mark.parametrize("maker", [LRU, ARC])
def test_a_batch_inserts_through_the_c_step_with_what_insert_would_do(maker: type) -> None:
    """What a residency index calls per key of a store: the C step itself (a Python frame
    of the policy's per key was 4% of the loop's time at scale), same outcome as insert."""
    one = maker(8)
    partition = TierPartition("cpu", 8)
    partition.add_namespace("ns", maker.name)
    batch = partition.policy("ns")
    insert = partition.inserter("ns", 4)
    assert type(insert).__name__ == "builtin_function_or_method"
    for i in range(4):
        one.insert(chunk_key(i), chunk_key(i - 1) if i else None)
        insert(chunk_key(i), chunk_key(i - 1) if i else None)
    partition.count_inserted(4)
    assert repr(one) == repr(batch) and drain(one) == drain(batch)


def test_arcs_capacity_cannot_change_under_its_c_steps() -> None:
    """Regression (review): the C steps copy the capacity that sizes the ghost lists; a
    reassigned ``capacity`` made the two disagree silently."""
    arc = ARC(2)
    with pytest.raises(AttributeError):
        arc.capacity = 4  # type: ignore[misc]
    assert arc.capacity == 2


@pytest.mark.parametrize("maker", [LRU, ARC, S3FIFO])
def test_a_policy_cleared_in_steps_is_empty_after_the_first_and_works_as_new(
    maker: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a closing manager does to its policies (tiered_kv/release.py): every key,
    ghost, prefix link and parked key goes, a few at a time."""
    monkeypatch.setattr(release, "STEP", 7)
    policy = maker(64)
    for chain in range(20):  # chains of 4: links, and parked keys after the evictions
        for j in range(4):
            policy.insert(chunk_key(chain * 4 + j), chunk_key(chain * 4 + j - 1) if j else None)
        if len(policy) > 48:
            assert policy.evict(8, never) is not None
    for i in range(0, 80, 5):
        if chunk_key(i) in policy:
            policy.touch(chunk_key(i))
    assert isinstance(policy, SteppedClearPolicy)
    steps = policy.clear_in_steps()
    next(steps)
    assert len(policy) == 0 and not any(chunk_key(i) in policy for i in range(80))
    assert sum(1 for _ in steps) >= 40 // 7  # the rest, a step at a time
    assert policy.evict(1, never) is None
    for i in range(64):  # the same keys again, as new: nothing of them is left behind
        policy.insert(chunk_key(i), chunk_key(i - 1) if i % 4 else None)
    assert len(policy) == 64 and len(drain(policy)) == 64


@pytest.mark.parametrize(("maker", "hit_all"), [(LRU, False), (ARC, True), (S3FIFO, False)])
def test_a_policy_cleared_in_steps_lets_go_of_its_parked_keys_a_step_at_a_time(
    maker: type, hit_all: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a churn nearly every resident key of a prefix tree is parked (passed over for
    its successors): a million of them took 40 ms to free in the first step of a closing
    manager's clear. They now go a step at a time, like the policy's tables, while the
    policy reads empty and works as new from the first step."""
    monkeypatch.setattr(release, "STEP", 5)

    def grow_and_churn(policy: object, first: int) -> None:
        # Chains of 8 whose leaves are hit (ARC: every key first, into its second list): an
        # eviction walks past every ancestor, parking it.
        keys = [chunk_key(first + i) for i in range(400)]
        for i, key in enumerate(keys):
            policy.insert(key, keys[i - 1] if i % 8 else None)
        for key in [*(keys if hit_all else []), *keys[7::8]]:
            policy.touch(key)
        assert policy.evict(1, never) is not None

    policy = maker(400)
    grow_and_churn(policy, 0)
    parked = policy._links._parked  # white box: the dict the parked keys are in
    before = len(parked)
    assert before > 100
    steps = policy.clear_in_steps()
    next(steps)
    assert len(policy) == 0 and not any(chunk_key(i) in policy for i in range(400))
    assert len(parked) == before  # none let go of in the first step
    sizes = [len(parked) for _ in steps]
    assert sizes[-1] == 0 and all(a - b <= 5 for a, b in zip([before, *sizes], sizes, strict=False))
    grow_and_churn(policy, 1000)  # the walk parks into the new dict, not the old one
    assert not parked and len(policy._links._parked) > 100
    assert len(drain(policy)) == 399


def test_a_walk_swaps_its_parked_dict_for_a_dict_only() -> None:
    lru = LRU(8)
    walk = lru._lists
    mine = lru._links._parked
    fresh: dict[bytes, tuple[int, bytes | None]] = {}
    assert walk.swap_parked(fresh) is mine
    assert walk.swap_parked(mine) is fresh
    with pytest.raises(TypeError, match="dict"):
        walk.swap_parked([])  # type: ignore[arg-type]

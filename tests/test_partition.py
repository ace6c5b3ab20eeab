"""One tier shared among namespaces: a policy each, quotas, and all-or-nothing room-making."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from typing import ClassVar, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tiered_kv.errors import ConfigError, PolicyError, UnknownPluginError
from tiered_kv.partition import TierPartition
from tiered_kv.policies import LRU
from tiered_kv.registry import POLICIES
from tiered_kv.testing import chunk_key

_ids = itertools.count()


def fresh(n: int) -> list[bytes]:
    return [chunk_key(next(_ids)) for _ in range(n)]


def store(
    partition: TierPartition, namespace: str, keys: list[bytes], protected: frozenset[bytes] = frozenset()
) -> bool:
    """Store ``keys`` as the manager would: make room, then insert. False if there was no room."""
    victims = partition.make_room(namespace, len(keys), protected.__contains__)
    if victims is None:
        return False
    for key in keys:
        partition.insert(namespace, key)
    return True


def resident(partition: TierPartition, namespace: str, keys: list[bytes]) -> list[bytes]:
    return [key for key in keys if partition.contains(namespace, key)]


def test_a_scan_in_one_namespace_cannot_evict_another_namespace_under_its_quota() -> None:
    tier = TierPartition("cpu", 100)
    tier.add_namespace("chat", "lru", quota=40)
    tier.add_namespace("batch", "s3fifo")
    kept = fresh(40)
    assert store(tier, "chat", kept)
    for _ in range(200):  # 1,600 one-off chunks, 8 at a time
        assert store(tier, "batch", fresh(8))
    assert resident(tier, "chat", kept) == kept
    assert tier.usage("chat") == 40 and tier.usage("batch") == 60 and tier.used == 100


def test_a_namespace_under_its_quota_takes_back_room_lent_to_others() -> None:
    tier = TierPartition("cpu", 100)
    tier.add_namespace("a", "arc", quota=30)
    tier.add_namespace("b", "lru")
    assert store(tier, "b", fresh(100))  # a is idle: b may use the whole tier
    assert store(tier, "a", fresh(30))
    assert tier.usage("a") == 30 and tier.usage("b") == 70


def test_namespaces_above_their_quotas_share_the_rest_evenly() -> None:
    tier = TierPartition("cpu", 100)
    tier.add_namespace("a", "lru", quota=20)
    tier.add_namespace("b", "lru")
    assert store(tier, "a", fresh(100))
    for _ in range(50):
        assert store(tier, "b", fresh(4))
    # 80 shared chunks, 40 each above the quotas.
    assert tier.usage("a") == 60 and tier.usage("b") == 40


def test_when_there_is_room_nothing_is_evicted() -> None:
    tier = TierPartition("cpu", 10)
    tier.add_namespace("a", "lru")
    assert tier.make_room("a", 10, lambda key: False) == {}
    assert store(tier, "a", fresh(6))
    assert tier.make_room("a", 4, lambda key: False) == {}
    assert tier.free == 4


def test_victims_are_reported_by_namespace_and_forgotten() -> None:
    tier = TierPartition("cpu", 10)
    tier.add_namespace("a", "lru")
    tier.add_namespace("b", "lru")
    a_keys = fresh(10)
    assert store(tier, "a", a_keys)
    victims = tier.make_room("b", 3, lambda key: False)
    assert victims == {"a": a_keys[:3]}
    assert tier.used == 7 and tier.usage("a") == 7
    assert not any(tier.contains("a", key) for key in a_keys[:3])


def test_room_that_needs_a_protected_chunk_is_refused_and_nothing_changes() -> None:
    tier = TierPartition("cpu", 10)
    tier.add_namespace("a", "s3fifo")
    tier.add_namespace("b", "lru", quota=4)
    a_keys, b_keys = fresh(6), fresh(4)
    assert store(tier, "a", a_keys) and store(tier, "b", b_keys)
    pinned = frozenset(a_keys[1:])
    assert tier.make_room("a", 2, pinned.__contains__) is None  # only one unpinned chunk of a, b at quota
    assert resident(tier, "a", a_keys) == a_keys and resident(tier, "b", b_keys) == b_keys
    assert tier.used == 10


def two_of_three_full() -> tuple[TierPartition, list[bytes], list[bytes]]:
    """A tier of 10 that namespaces a and b fill with 5 chunks each; c holds none."""
    tier = TierPartition("cpu", 10)
    for name in "abc":
        tier.add_namespace(name, "lru")
    a_keys, b_keys = fresh(5), fresh(5)
    assert store(tier, "a", a_keys) and store(tier, "b", b_keys)
    return tier, a_keys, b_keys


def test_a_shortfall_in_one_namespace_is_made_up_by_another() -> None:
    tier, a_keys, b_keys = two_of_three_full()
    pinned = frozenset(a_keys[1:])  # a can give one chunk, not the two planned
    victims = tier.make_room("c", 4, pinned.__contains__)
    assert victims == {"a": a_keys[:1], "b": b_keys[:3]}
    assert tier.used == 6


def test_when_every_namespace_falls_short_the_victims_taken_are_put_back() -> None:
    tier, a_keys, b_keys = two_of_three_full()
    pinned = frozenset(a_keys[1:] + b_keys[2:])  # three unpinned chunks in all, four wanted
    assert tier.make_room("c", 4, pinned.__contains__) is None
    assert resident(tier, "a", a_keys) == a_keys and resident(tier, "b", b_keys) == b_keys
    assert tier.used == 10 and tier.usage("c") == 0


def test_inserting_into_a_full_tier_is_an_error() -> None:
    tier = TierPartition("cpu", 2)
    tier.add_namespace("a", "lru")
    assert store(tier, "a", fresh(2))
    with pytest.raises(PolicyError, match="full"):
        tier.insert("a", chunk_key(10**6))


def test_misconfiguration_is_reported() -> None:
    tier = TierPartition("cpu", 10)
    tier.add_namespace("a", "lru", quota=6)
    with pytest.raises(ConfigError, match="only 4"):
        tier.add_namespace("b", "lru", quota=5)
    with pytest.raises(PolicyError):
        tier.add_namespace("a", "arc")
    with pytest.raises(UnknownPluginError):
        tier.add_namespace("c", "mru")
    with pytest.raises(PolicyError, match="not added"):
        tier.usage("nobody")
    with pytest.raises(PolicyError):
        tier.make_room("a", -1, lambda key: False)
    with pytest.raises(ConfigError):
        TierPartition("cpu", 0)
    assert tier.namespaces() == ["a"] and tier.quota("a") == 6 and tier.policy("a").name == "lru"


class PartitionMachine(RuleBasedStateMachine):
    """Random stores, hits, drops and pins across three namespaces, against a model."""

    CAPACITY = 24
    QUOTAS: ClassVar[dict[str, int]] = {"a": 8, "b": 4, "c": 0}
    POLICIES: ClassVar[dict[str, str]] = {"a": "lru", "b": "arc", "c": "s3fifo"}

    def __init__(self) -> None:
        super().__init__()
        self.tier = TierPartition("cpu", self.CAPACITY)
        for name, quota in self.QUOTAS.items():
            self.tier.add_namespace(name, self.POLICIES[name], quota=quota)
        self.model: dict[str, set[bytes]] = {name: set() for name in self.QUOTAS}

    @rule(namespace=st.sampled_from("abc"), n=st.integers(1, 10), pin=st.floats(0, 1), data=st.data())
    def store(self, namespace: str, n: int, pin: float, data: st.DataObject) -> None:
        everything = sorted(set().union(*self.model.values()))
        pinned = frozenset(key for key in everything if data.draw(st.floats(0, 1)) < pin)
        before = {name: set(keys) for name, keys in self.model.items()}
        victims = self.tier.make_room(namespace, n, pinned.__contains__)
        if victims is None:
            assert self.current() == before, "a refused make_room changed the resident chunks"
            return
        for name, keys in victims.items():
            assert not set(keys) & pinned, "a pinned chunk was evicted"
            if name != namespace:
                assert len(before[name]) - len(keys) >= self.QUOTAS[name], f"{name} pushed below its quota"
            self.model[name] -= set(keys)
        for key in fresh(n):
            self.tier.insert(namespace, key)
            self.model[namespace].add(key)

    @precondition(lambda self: any(self.model.values()))
    @rule(data=st.data())
    def hit_or_drop(self, data: st.DataObject) -> None:
        namespace = data.draw(st.sampled_from([name for name, keys in self.model.items() if keys]))
        key = data.draw(st.sampled_from(sorted(self.model[namespace])))
        if data.draw(st.booleans()):
            self.tier.touch(namespace, key)
        else:
            self.tier.remove(namespace, key)
            self.model[namespace].discard(key)

    def current(self) -> dict[str, set[bytes]]:
        return {name: {key for key in self.model_keys() if self.tier.contains(name, key)} for name in self.model}

    def model_keys(self) -> set[bytes]:
        return set().union(*self.model.values())

    @invariant()
    def matches_the_model(self) -> None:
        assert self.tier.used == sum(len(keys) for keys in self.model.values()) <= self.CAPACITY
        for name, keys in self.model.items():
            assert self.tier.usage(name) == len(keys)
            assert all(self.tier.contains(name, key) for key in keys)


TestPartitionMachine = PartitionMachine.TestCase
TestPartitionMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


class _KeyByKey:
    """A plug-in policy with the protocol's methods only (no ``insert_many``): LRU's order."""

    name = "key-by-key"

    def __init__(self, capacity: int, **_: object) -> None:
        self._inner = LRU(capacity)
        self.inserted: list[bytes] = []

    def __len__(self) -> int:
        return len(self._inner)

    def __contains__(self, key: object) -> bool:
        return key in self._inner

    def insert(self, key: bytes, parent: bytes | None = None) -> None:
        self._inner.insert(key, parent)
        self.inserted.append(key)

    def touch(self, key: bytes) -> None:
        self._inner.touch(key)

    def remove(self, key: bytes) -> None:
        self._inner.remove(key)

    def evict(self, n: int, protected: Callable[[bytes], bool]) -> list[bytes] | None:
        return self._inner.evict(n, protected)


@pytest.fixture
def key_by_key() -> Iterator[None]:
    POLICIES.register(_KeyByKey.name, _KeyByKey)
    yield
    POLICIES.unregister(_KeyByKey.name)


@pytest.mark.usefixtures("key_by_key")
@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo", _KeyByKey.name])
def test_a_warm_restarts_batches_keep_their_order_in_every_policy(policy: str) -> None:
    tier = TierPartition("nvme", 10)
    tier.add_namespace("a", policy)
    first, second = fresh(4), fresh(3)
    tier.insert_many("a", first)
    tier.insert_many("a", second)
    assert tier.used == 7 and resident(tier, "a", first + second) == first + second
    if policy == _KeyByKey.name:
        assert cast(_KeyByKey, tier.policy("a")).inserted == first + second
    assert tier.make_room("a", 5, lambda key: False) == {"a": first[:2]}  # the oldest first
    with pytest.raises(PolicyError, match="full"):
        tier.insert_many("a", fresh(6))


@settings(max_examples=150, deadline=None)
@given(
    policy=st.sampled_from(["lru", "arc", "s3fifo"]),
    steps=st.lists(
        st.tuples(st.sampled_from(["store", "touch", "remove"]), st.integers(1, 9), st.floats(0, 1)), max_size=40
    ),
)
def test_a_namespace_alone_in_its_tier_loses_the_victims_it_would_lose_beside_an_idle_one(
    policy: str, steps: list[tuple[str, int, float]]
) -> None:
    """A tier of one namespace skips the plan that shares the victims out; the same
    traffic beside an idle namespace goes through it, and must evict the same keys."""
    alone, beside = TierPartition("cpu", 16, rng=random.Random(7)), TierPartition("cpu", 16, rng=random.Random(7))
    alone.add_namespace("a", policy)
    beside.add_namespace("a", policy)
    beside.add_namespace("idle", "lru")
    held: list[bytes] = []
    for op, n, fraction in steps:
        if op == "store":
            pinned = frozenset(held[: int(len(held) * fraction)])
            keys = fresh(n)
            parents = dict(zip(keys[1:], keys, strict=False))
            victims = alone.make_room("a", n, pinned.__contains__)
            assert victims == beside.make_room("a", n, pinned.__contains__)
            if victims is None:
                continue
            gone = set(victims.get("a", []))
            held = [key for key in held if key not in gone]
            for key in keys:
                alone.insert("a", key, parents.get(key))
                beside.insert("a", key, parents.get(key))
            held += keys
        elif held:
            key = held[int(fraction * (len(held) - 1))]
            if op == "touch":
                alone.touch("a", key)
                beside.touch("a", key)
            else:
                alone.remove("a", key)
                beside.remove("a", key)
                held.remove(key)
        assert alone.used == beside.used == len(held)

"""LRU's and ARC's steps in C (:class:`~tiered_kv._keytable.PrefixLists`: evictions of many
keys, ARC's insert, touch) against the Python they replaced: the same victims in the same
order, and the same lists, ghosts, parked keys, successor counts and ARC target after
every step of random traces."""

from __future__ import annotations

import gc
import heapq
import random
import sys
import tracemalloc
from collections.abc import Callable

import pytest

from tiered_kv._keytable import KeyInts, KeyOrder, PrefixLists
from tiered_kv.errors import PolicyError
from tiered_kv.policies import ARC, LRU
from tiered_kv.testing import chunk_key

Key = bytes
ABSENT = object()


# -- the reference: policies/prefix.py's LeafWalk and Victims, and ARC's insert, as they were


class RefVictims:
    def __init__(self, successors: KeyInts, parent_of: Callable[[Key], Key | None]) -> None:
        self.successors = successors
        self.parent_of = parent_of
        self.keys: list[Key] = []
        self.taken: dict[Key, int] = {}

    def take(self, key: Key) -> Key | None:
        self.keys.append(key)
        parent = self.parent_of(key)
        if parent is None:
            return None
        self.taken[parent] = self.taken.get(parent, 0) + 1
        return parent if self.taken[parent] == self.successors[parent] else None


class RefWalk:
    def __init__(
        self, keys: KeyOrder, victims: RefVictims, protected: Callable[[Key], bool], parked: dict, place: int
    ) -> None:
        self.keys = iter(keys)
        self.victims, self.protected, self.parked, self.place = victims, protected, parked, place
        self.passed: dict[Key, int] = {}
        self.ready: list[tuple[int, Key]] = []
        self.seen = 0
        self.parked_rank = 0

    def next(self) -> Key | None:
        if self.ready:
            return heapq.heappop(self.ready)[1]
        successors, taken = self.victims.successors, self.victims.taken
        for key in self.keys:
            self.seen += 1
            if self.protected(key):
                continue
            if key not in successors or successors[key] == taken.get(key, 0):
                return key
            self.passed[key] = self.seen
        return None

    def freed(self, key: Key) -> bool:
        rank = self.passed.pop(key, None)
        if rank is None:
            parked = self.parked.get(key)
            if parked is None or parked[0] != self.place or self.protected(key):
                return False
            self.parked_rank -= 1
            rank = self.parked_rank
        heapq.heappush(self.ready, (rank, key))
        return True


def parent_of(lists: list[KeyOrder], parked: dict) -> Callable[[Key], Key | None]:
    def find(key: Key) -> Key | None:
        for keys in lists:
            parent = keys.get(key, ABSENT)
            if parent is not ABSENT:
                return parent  # type: ignore[return-value]
        return parked[key][1]  # type: ignore[no-any-return]

    return find


def ref_evict(policy: LRU | ARC, n: int, protected: Callable[[Key], bool]) -> list[Key] | None:
    """``policy.evict(n, protected)`` for n > 1, as the Python walk did it."""
    links = policy._links
    if isinstance(policy, ARC):
        lists, places, ghosts = [policy._t1, policy._t2], [1, 2], [policy._b1, policy._b2]
    else:
        lists, places, ghosts = [policy._order], [0], []
    if n > len(policy):
        return None
    victims = RefVictims(links._successors, parent_of(lists, links._parked))
    walks = [RefWalk(keys, victims, protected, links._parked, place) for keys, place in zip(lists, places, strict=True)]
    left = len(lists[0]) + links.parked(places[0])
    while len(victims.keys) < n:
        w = 0 if len(lists) == 1 or (left > 0 and left > policy._lists.target) else 1
        key = walks[w].next()
        if key is None:
            if len(lists) == 1:
                return None
            w = 1 - w
            key = walks[w].next()
            if key is None:
                return None
        if w == 0:
            left -= 1
        freed = victims.take(key)
        if freed is not None:
            any(walk.freed(freed) for walk in walks)
    for keys, walk, place in zip(lists, walks, places, strict=True):
        for key in list(walk.passed):
            links.park(key, place, keys.pop(key))
    for key in victims.keys:
        w = next((i for i, keys in enumerate(lists) if key in keys), None)
        if w is None:
            place, parent = links.unpark(key)  # type: ignore[misc]
            w = places.index(place)
        else:
            parent = lists[w].pop(key)
        if ghosts:
            ghosts[w].add(key)
        links.unlink(key, parent)  # type: ignore[arg-type]
    return victims.keys


def ref_arc_insert(arc: ARC, key: Key, parent: Key | None) -> None:
    t1, t2, b1, b2, links, lists = arc._t1, arc._t2, arc._b1, arc._b2, arc._links, arc._lists
    if key in t1 or key in t2 or links.is_parked(key):
        raise PolicyError(f"key {key.hex()} is already resident")
    links.link(key, parent)
    if b1.has(key):
        b1.hit(key)
        lists.target = min(float(arc.capacity), lists.target + max(1.0, len(b2) / (len(b1) + 1)))
        t2[key] = parent
    elif b2.has(key):
        b2.hit(key)
        lists.target = max(0.0, lists.target - max(1.0, len(b1) / (len(b2) + 1)))
        t2[key] = parent
    else:
        t1[key] = parent
        if len(b1) or len(b2):
            over = len(t1) + links.parked(1) + len(b1) - arc.capacity
            if over > 0:
                for _ in range(min(over, len(b1))):
                    b1.pop_oldest()
                return
            over_all = over + len(t2) + links.parked(2) + len(b2) - arc.capacity
            for _ in range(min(over_all, len(b2))):
                b2.pop_oldest()


def ref_lru_insert(lru: LRU, key: Key, parent: Key | None) -> None:
    order, links = lru._order, lru._links
    if key in order or links.is_parked(key):
        raise PolicyError(f"key {key.hex()} is already resident")
    links.link(key, parent)
    order[key] = parent


def ref_touch(policy: LRU | ARC, key: Key) -> None:
    last = policy._t2 if isinstance(policy, ARC) else policy._order
    if key in last:
        last.move_to_end(key)
        return
    parent = policy._t1.pop(key, ABSENT) if isinstance(policy, ARC) else ABSENT
    last[key] = policy._links.take_parked(key) if parent is ABSENT else parent  # type: ignore[assignment]


# -- the comparison


def state(policy: LRU | ARC) -> tuple[object, ...]:
    links = policy._links
    common = (dict(links._parked), list(links._successors.items()), links._parked_at, len(policy))
    if isinstance(policy, ARC):
        lists = (list(policy._t1.items()), list(policy._t2.items()), list(policy._b1), list(policy._b2))
        return (*lists, policy.target, *common)
    return (list(policy._order.items()), *common)


def insert(policy: LRU | ARC, key: Key, parent: Key | None, reference: bool) -> str | None:
    try:
        if reference and isinstance(policy, ARC):
            ref_arc_insert(policy, key, parent)
        elif reference:
            ref_lru_insert(policy, key, parent)
        else:
            policy.insert(key, parent)
    except PolicyError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("make", [LRU, ARC])
@pytest.mark.parametrize("seed", range(40))
def test_the_c_steps_decide_as_the_python_ones_did(make: type[LRU | ARC], seed: int) -> None:
    rng = random.Random(seed)
    capacity = rng.choice([2, 3, 5, 8, 16, 40])
    fast, ref = make(capacity), make(capacity)
    universe = [chunk_key(i) for i in range(6 * capacity)]  # keys come back: ghost hits
    resident: list[Key] = []
    for _ in range(600):
        roll = rng.random()
        if roll < 0.45 and len(resident) < capacity:
            key = rng.choice(universe)
            if key in resident:
                continue
            parent = rng.choice(resident) if resident and rng.random() < 0.8 else None
            parent = key if rng.random() < 0.03 else parent
            errors = [insert(fast, key, parent, False), insert(ref, key, parent, True)]
            assert errors[0] == errors[1]
            if errors[0] is None:
                resident.append(key)
        elif roll < 0.75:
            guarded = set(rng.sample(resident, min(len(resident), rng.randrange(3))))
            n = rng.randrange(2, min(len(resident), 18) + 3)
            victims = fast.evict(n, guarded.__contains__)
            assert victims == ref_evict(ref, n, guarded.__contains__)
            for key in victims or ():
                resident.remove(key)
        elif roll < 0.92 and resident:
            key = rng.choice(resident)
            fast.touch(key)
            ref_touch(ref, key)
        elif resident:
            key = rng.choice(resident)
            fast.remove(key)
            ref.remove(key)
            resident.remove(key)
        assert state(fast) == state(ref)


@pytest.mark.parametrize("make", [LRU, ARC])
def test_an_insert_of_a_resident_key_raises_and_changes_nothing(make: type[LRU | ARC]) -> None:
    policy = make(4)
    policy.insert(chunk_key(0))
    policy.insert(chunk_key(1), chunk_key(0))
    policy.insert(chunk_key(2), chunk_key(1))
    assert policy.evict(1, lambda key: False) == [chunk_key(2)]
    assert policy._links.is_parked(chunk_key(0))  # walked past with a successor: resident still
    before = state(policy)
    for resident in (chunk_key(1), chunk_key(0)):
        with pytest.raises(PolicyError, match="already resident"):
            policy.insert(resident, chunk_key(3))
    with pytest.raises(PolicyError, match="own predecessor"):
        policy.insert(chunk_key(3), chunk_key(3))
    with pytest.raises(TypeError):
        policy.insert("not bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        policy.insert(chunk_key(3), "not bytes")  # type: ignore[arg-type]
    assert state(policy) == before


def test_a_protected_check_that_changes_the_lists_stops_the_eviction() -> None:
    lru = LRU(8)
    for i in range(4):
        lru.insert(chunk_key(i))

    def meddling(key: Key) -> bool:
        lru.touch(chunk_key(0))
        return False

    with pytest.raises(RuntimeError, match="changed during eviction"):
        lru.evict(2, meddling)


def test_prefix_lists_checks_its_tables() -> None:
    order, counts = KeyOrder(), KeyInts()
    with pytest.raises(TypeError):
        PrefixLists((counts,), (0,), counts, {}, [0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one place"):
        PrefixLists((order,), (0, 1), counts, {}, [0, 0])
    with pytest.raises(ValueError, match="every place"):
        PrefixLists((order,), (3,), counts, {}, [0])
    with pytest.raises(TypeError, match="two lists"):
        PrefixLists((order,), (0,), counts, {}, [0]).arc_insert(chunk_key(0))
    with pytest.raises(TypeError, match="one list"):
        PrefixLists((order, KeyOrder()), (0, 1), counts, {}, [0, 0]).lru_insert(chunk_key(0))
    # Tables a policy broke are errors, never reads out of bounds.
    with pytest.raises(TypeError, match="parked entry"):
        PrefixLists((order,), (0,), counts, {chunk_key(1): "not a pair"}, [0]).touch(chunk_key(1))
    with pytest.raises(IndexError, match="no place 5"):
        PrefixLists((order,), (0,), counts, {chunk_key(1): (5, None)}, [0]).touch(chunk_key(1))


@pytest.mark.parametrize("make", [LRU, ARC])
def test_evictions_in_c_leak_no_memory(make: type[LRU | ARC]) -> None:
    keys = [chunk_key(i) for i in range(20_000)]

    def churn(policy: LRU | ARC, start: int) -> None:
        for i in range(start, start + 2_000, 8):  # chains of 8: parking and release on every eviction
            assert policy.evict(8, lambda key: False) is not None
            for j in range(8):
                policy.insert(keys[i + j], keys[i + j - 1] if j else None)

    policy = make(64)
    for i in range(0, 64, 8):
        for j in range(8):
            policy.insert(keys[i + j], keys[i + j - 1] if j else None)
    churn(policy, 64)  # ghosts and tables at their steady size
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for start in range(2_064, 18_000, 2_000):
            churn(policy, start)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 16_384
    never_inserted = [sys.getrefcount(key) for key in keys[-936:]]
    assert [sys.getrefcount(key) for key in keys[64:1_000]] == never_inserted  # long gone: no reference left

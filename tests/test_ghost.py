"""The ghost queue ARC and S3-FIFO remember evicted keys in."""

from __future__ import annotations

import collections
import copy
import pickle
import sys
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_kv.policies.ghost import GhostQueue
from tiered_kv.testing import chunk_key


def test_it_forgets_the_oldest_ghost_beyond_its_limit() -> None:
    ghosts = GhostQueue(3)
    for i in range(5):
        ghosts.add(chunk_key(i))
    assert len(ghosts) == 3
    assert [chunk_key(i) in ghosts for i in range(5)] == [False, False, True, True, True]


def test_a_ghost_hit_forgets_the_key_and_says_so() -> None:
    ghosts = GhostQueue(3)
    ghosts.add(chunk_key(1))
    assert ghosts.hit(chunk_key(1)) and chunk_key(1) not in ghosts
    assert not ghosts.hit(chunk_key(1))
    assert not ghosts


def test_pop_oldest_passes_over_keys_already_forgotten() -> None:
    ghosts = GhostQueue(5)
    for i in range(3):
        ghosts.add(chunk_key(i))
    ghosts.hit(chunk_key(0))
    ghosts.pop_oldest()
    assert chunk_key(1) not in ghosts and chunk_key(2) in ghosts and len(ghosts) == 1


def test_adding_a_ghost_again_keeps_its_place() -> None:
    ghosts = GhostQueue(2)
    ghosts.add(chunk_key(1))
    ghosts.add(chunk_key(2))
    ghosts.add(chunk_key(1))
    ghosts.add(chunk_key(3))
    assert chunk_key(1) not in ghosts and chunk_key(2) in ghosts


@pytest.mark.parametrize("limit", [0, -1])
def test_a_queue_with_no_room_keeps_no_ghost(limit: int) -> None:
    ghosts = GhostQueue(limit)
    ghosts.add(chunk_key(1))
    assert len(ghosts) == 0 and not ghosts.has(chunk_key(1))


def test_many_ghost_hits_do_not_grow_its_memory() -> None:
    ghosts = GhostQueue(1000)
    once = GhostQueue(1000)
    once.add(chunk_key(0))
    for i in range(10_000):
        ghosts.add(chunk_key(i))
        ghosts.hit(chunk_key(i))
    assert len(ghosts) == 0 and sys.getsizeof(ghosts._keys) == sys.getsizeof(once._keys)


def test_a_key_evicted_again_starts_over_as_the_newest_ghost() -> None:
    """Before the queue was a KeyOrder, the key's old entry, left behind by its hit,
    made it leave first."""
    ghosts = GhostQueue(2)
    ghosts.add(chunk_key(1))
    ghosts.add(chunk_key(2))
    assert ghosts.hit(chunk_key(1))
    ghosts.add(chunk_key(1))
    ghosts.add(chunk_key(3))
    assert list(ghosts) == [chunk_key(1), chunk_key(3)]


@settings(max_examples=300, deadline=None)
@given(
    limit=st.integers(1, 5),
    steps=st.lists(st.tuples(st.sampled_from(["add", "hit", "pop"]), st.integers(0, 7)), max_size=60),
)
def test_the_queue_behaves_as_an_ordered_dict_of_its_ghosts(limit: int, steps: list[tuple[str, int]]) -> None:
    ghosts = GhostQueue(limit)
    model: collections.OrderedDict[bytes, None] = collections.OrderedDict()
    for op, i in steps:
        key = chunk_key(i)
        if op == "add":
            ghosts.add(key)
            model.setdefault(key, None)
            while len(model) > limit:
                model.popitem(last=False)
        elif op == "hit":
            assert ghosts.hit(key) == (key in model)
            model.pop(key, None)
        else:
            ghosts.pop_oldest()
            if model:
                model.popitem(last=False)
        assert list(ghosts) == list(model) and len(ghosts) == len(model) <= limit
        assert bool(ghosts) == bool(model) and all(k in ghosts for k in model)


@pytest.mark.parametrize("clone", [copy.copy, copy.deepcopy, lambda ghosts: pickle.loads(pickle.dumps(ghosts))])
def test_a_copy_has_the_same_limit_and_ghosts_in_the_same_order(clone: Callable[[GhostQueue], GhostQueue]) -> None:
    ghosts = GhostQueue(3)
    for i in range(4):
        ghosts.add(chunk_key(i))
    ghosts.hit(chunk_key(2))
    copied = clone(ghosts)
    assert type(copied) is GhostQueue and copied.limit == 3 and set(copied) == {chunk_key(1), chunk_key(3)}
    copied.add(chunk_key(4))
    copied.add(chunk_key(5))
    assert set(copied) == {chunk_key(3), chunk_key(4), chunk_key(5)}, "the oldest went first"

"""The ghost queue ARC and S3-FIFO remember evicted keys in."""

from __future__ import annotations

import copy
import pickle
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


def test_many_ghost_hits_do_not_grow_its_memory() -> None:
    ghosts = GhostQueue(1000)
    for i in range(10_000):
        ghosts.add(chunk_key(i))
        ghosts.hit(chunk_key(i))
    assert len(ghosts) == 0 and len(ghosts._order) <= 64 + 1


def test_a_key_taken_out_with_a_plain_set_method_leaves_a_dead_entry_that_is_passed_over() -> None:
    ghosts = GhostQueue(3)
    for i in range(3):
        ghosts.add(chunk_key(i))
    ghosts.discard(chunk_key(0))  # set's own discard: no ghost hit, the same bookkeeping
    ghosts.pop_oldest()
    assert list(ghosts) == [chunk_key(2)] and len(ghosts) == 1


@settings(max_examples=300, deadline=None)
@given(
    limit=st.integers(1, 5),
    steps=st.lists(st.tuples(st.sampled_from(["add", "hit", "pop"]), st.integers(0, 7)), max_size=60),
)
def test_the_queue_behaves_as_its_documented_model(limit: int, steps: list[tuple[str, int]]) -> None:
    """A list of entries, oldest first, and the set of live keys: a hit kills a key's
    entries; an add of a live key changes nothing; pop forgets the oldest live entry's
    key (a key's dead entries ahead of its live one count as its place)."""
    ghosts = GhostQueue(limit)
    entries: list[bytes] = []
    live: set[bytes] = set()

    def pop_model() -> None:
        while entries:
            key = entries.pop(0)
            if key in live:
                live.remove(key)
                return

    for op, i in steps:
        key = chunk_key(i)
        if op == "add":
            ghosts.add(key)
            if key not in live:
                live.add(key)
                entries.append(key)
                while len(live) > limit:
                    pop_model()
        elif op == "hit":
            assert ghosts.hit(key) == (key in live)
            live.discard(key)
        else:
            ghosts.pop_oldest()
            pop_model()
        assert set(ghosts) == live and len(ghosts) == len(live) <= limit
        assert bool(ghosts) == bool(live)


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


def test_keys_put_in_with_sets_own_update_cannot_make_add_loop_for_ever() -> None:
    ghosts = GhostQueue(1)
    ghosts.update({chunk_key(1), chunk_key(2)})
    ghosts.add(chunk_key(3))  # returns: the keys without an entry cannot be popped, and are not waited for
    assert set(ghosts) == {chunk_key(1), chunk_key(2)}

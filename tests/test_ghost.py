"""The ghost queue ARC and S3-FIFO remember evicted keys in."""

from __future__ import annotations

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
    assert ghosts.discard(chunk_key(1)) and chunk_key(1) not in ghosts
    assert not ghosts.discard(chunk_key(1))
    assert not ghosts


def test_pop_oldest_passes_over_keys_already_forgotten() -> None:
    ghosts = GhostQueue(5)
    for i in range(3):
        ghosts.add(chunk_key(i))
    ghosts.discard(chunk_key(0))
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
        ghosts.discard(chunk_key(i))
    assert len(ghosts) == 0 and len(ghosts._order) <= 64 + 1

"""Admission filters: seen-k (store a chunk once it has been seen k times) and its
capacity-adaptive variant."""

from __future__ import annotations

import random

import pytest

from tiered_kv.errors import PolicyError
from tiered_kv.interfaces import AdmissionFilter
from tiered_kv.policies import LRU, AdaptiveSeenK, SeenK
from tiered_kv.policies.adaptive_admission import OBSERVED_ONE_IN
from tiered_kv.policy_factory import make_admission_filter
from tiered_kv.registry import ADMISSION_FILTERS
from tiered_kv.testing import chunk_key


def test_a_key_is_admitted_on_its_kth_sighting_and_not_before() -> None:
    admission = SeenK(16, k=3)
    assert [admission.admit(chunk_key(1)) for _ in range(3)] == [False, False, True]


def test_sightings_of_other_keys_do_not_count() -> None:
    admission = SeenK(16, k=2)
    assert not admission.admit(chunk_key(1))
    assert not admission.admit(chunk_key(2))
    assert admission.admit(chunk_key(1))


def test_an_admitted_key_must_be_seen_k_times_again() -> None:
    admission = SeenK(16, k=2)
    admission.admit(chunk_key(1))
    assert admission.admit(chunk_key(1))
    assert len(admission) == 0
    assert not admission.admit(chunk_key(1))


def test_the_table_forgets_the_key_seen_longest_ago() -> None:
    admission = SeenK(3, k=2)
    for i in range(10):
        admission.admit(chunk_key(i))
    assert len(admission) == 3
    assert not admission.admit(chunk_key(0))  # forgotten: a first sighting again
    assert admission.admit(chunk_key(9))  # remembered


def test_k_of_one_admits_everything_and_counts_nothing() -> None:
    admission = SeenK(3, k=1)
    assert all(admission.admit(chunk_key(i)) for i in range(10))
    assert len(admission) == 0


@pytest.mark.parametrize(("capacity", "k"), [(0, 2), (4, 0), (4, -1)])
def test_a_bad_table_size_or_k_is_an_error(capacity: int, k: int) -> None:
    with pytest.raises(PolicyError):
        SeenK(capacity, k=k)


def test_they_are_registered_and_speak_the_protocol() -> None:
    assert ADMISSION_FILTERS.names() == ["seen_adaptive", "seen_k"]
    admission = make_admission_filter("seen_k", 8, k=4)
    assert isinstance(admission, SeenK) and isinstance(admission, AdmissionFilter)
    assert admission.k == 4 and admission.capacity == 8
    adaptive = make_admission_filter("seen_adaptive", 400, k=3)
    assert isinstance(adaptive, AdaptiveSeenK) and isinstance(adaptive, AdmissionFilter)
    assert adaptive.k == 3 and adaptive.capacity == 400 and adaptive.horizon == 100


# seen_adaptive


def run(admission: AdaptiveSeenK, keys: list[bytes]) -> list[bool]:
    """One prompt's missing chunks, each continuing the one before."""
    parent = None
    out = []
    for key in keys:
        out.append(admission.admit(key, parent))
        parent = key
    return out


@pytest.mark.parametrize(("capacity", "k"), [(0, 2), (4, 0)])
def test_adaptive_rejects_a_bad_table_size_or_k(capacity: int, k: int) -> None:
    with pytest.raises(PolicyError):
        AdaptiveSeenK(capacity, k=k)


def test_adaptive_starts_by_admitting_every_run_but_a_sample() -> None:
    admission = AdaptiveSeenK(400)
    runs = [run(admission, [chunk_key(1000 * r + i) for i in range(3)]) for r in range(1, 2 * OBSERVED_ONE_IN + 1)]
    refused = [r for r, admitted in enumerate(runs, start=1) if admitted != [True] * 3]
    assert refused == [OBSERVED_ONE_IN, 2 * OBSERVED_ONE_IN]
    assert runs[OBSERVED_ONE_IN - 1] == [False, False, False]  # refused as a whole


_fresh = iter(range(10_000_000, 100_000_000))


def sightings_with_reuse_distance(admission: AdaptiveSeenK, distance: int, rounds: int) -> None:
    """Each round: fresh one-chunk prompts until one is turned away, then ``distance - 1``
    others, then the turned-away one again."""
    for _ in range(rounds):
        while admission.admit(key := chunk_key(next(_fresh))):
            pass
        for _ in range(distance - 1):
            admission.admit(chunk_key(next(_fresh)))
        admission.admit(key)


def test_adaptive_turns_strict_when_chunks_come_back_beyond_what_the_tiers_hold() -> None:
    admission = AdaptiveSeenK(400)  # the tiers hold 100 chunks
    sightings_with_reuse_distance(admission, 150, rounds=10)
    assert not admission.lenient
    fresh = [chunk_key(next(_fresh)) for _ in range(3)]
    assert run(admission, fresh) == [False, False, False]
    assert run(admission, fresh) == [True, True, True]  # the second sighting


def test_adaptive_stays_lenient_when_chunks_come_back_within_what_the_tiers_hold() -> None:
    admission = AdaptiveSeenK(400)
    sightings_with_reuse_distance(admission, 50, rounds=10)
    assert admission.lenient


def test_adaptive_turns_lenient_again_when_reuse_comes_closer() -> None:
    admission = AdaptiveSeenK(400)
    sightings_with_reuse_distance(admission, 150, rounds=5)
    assert not admission.lenient
    sightings_with_reuse_distance(admission, 20, rounds=12)
    assert admission.lenient


def test_adaptive_keeps_its_table_within_capacity() -> None:
    admission = AdaptiveSeenK(64)
    rng = random.Random(3)
    for _ in range(5000):
        admission.admit(chunk_key(rng.randrange(10_000)))
    assert len(admission) <= 64


def hit_rate(admission: SeenK | AdaptiveSeenK, capacity: int, seed: int) -> float:
    """One chunk per prompt through an LRU of ``capacity`` chunks behind ``admission``: a
    quarter of the prompts ask for one of 30 hot chunks (each back about every 120
    prompts), the rest for a fresh chunk that, two times in five, comes back once 60
    prompts later."""
    rng = random.Random(seed)
    policy = LRU(capacity)
    hot = [rng.randbytes(16) for _ in range(30)]
    returning: dict[int, bytes] = {}
    hits = 0
    steps = 8000
    for step in range(steps):
        if step in returning:
            key = returning.pop(step)
        elif rng.random() < 0.25:
            key = rng.choice(hot)
        else:
            key = rng.randbytes(16)
            if rng.random() < 0.4:
                returning[step + 60] = key
        if key in policy:
            policy.touch(key)
            hits += 1
        elif admission.admit(key):
            if len(policy) == capacity:
                policy.evict(1, lambda k: False)
            policy.insert(key)
    return hits / steps


@pytest.mark.parametrize("seed", range(3))
def test_adaptive_does_as_well_as_the_better_fixed_rule_at_small_and_at_large_capacity(seed: int) -> None:
    """A 40-chunk tier loses every chunk before it returns if it stores them all; a
    400-chunk tier keeps them: seen-2 wins the first, seen-1 the second."""
    small = [hit_rate(SeenK(160, k=k), 40, seed) for k in (1, 2)]
    large = [hit_rate(SeenK(1600, k=k), 400, seed) for k in (1, 2)]
    assert small[1] > small[0] * 1.3 and large[0] > large[1] * 1.5  # the rules disagree
    assert hit_rate(AdaptiveSeenK(160), 40, seed) >= small[1] - 0.005
    assert hit_rate(AdaptiveSeenK(1600), 400, seed) >= large[0] - 0.015

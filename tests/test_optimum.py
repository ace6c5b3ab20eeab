"""Belady's MIN under prefix semantics: equal to an exhaustive search on small traces,
never beaten by a policy, and bounded by the compulsory misses."""

from __future__ import annotations

import hashlib
import itertools
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_kv.errors import ConfigError
from tiered_kv.optimum import compulsory_bound, offline_optimum
from tiered_kv.policies import ARC, LRU, S3FIFO, SeenK
from tiered_kv.traces import TraceRequest, distinct_chunks, replay, standard_traces


def request(path: tuple[int, ...]) -> TraceRequest:
    """A prompt whose chunks are the prefixes of ``path`` in a small tree of prompts."""
    keys = tuple(hashlib.blake2b(repr(path[: i + 1]).encode(), digest_size=16).digest() for i in range(len(path)))
    return TraceRequest(workload="tree", keys=keys, prompt_tokens=len(keys))


def brute_force(requests: list[TraceRequest], capacity: int) -> int:
    """The most hits of any cache: after each prompt, keep any subset of what it held
    and the prompt's chunks, of at most ``capacity`` chunks."""

    @cache
    def best(t: int, held: frozenset[bytes]) -> int:
        if t == len(requests):
            return 0
        keys = requests[t].keys
        hits = next((i for i, key in enumerate(keys) if key not in held), len(keys))
        choices = sorted(held | set(keys))
        return hits + max(
            best(t + 1, frozenset(kept))
            for size in range(min(capacity, len(choices)) + 1)
            for kept in itertools.combinations(choices, size)
        )

    return best(0, frozenset())


paths = st.lists(st.integers(0, 1), min_size=1, max_size=3).map(tuple)


@settings(max_examples=150, deadline=None)
@given(st.lists(paths, min_size=1, max_size=6), st.integers(1, 3))
def test_min_equals_an_exhaustive_search_on_small_traces(trace: list[tuple[int, ...]], capacity: int) -> None:
    requests = [request(path) for path in trace]
    assert offline_optimum(requests, capacity).hits == brute_force(requests, capacity)


def test_min_beats_lru_where_lru_is_not_optimal() -> None:
    # a b c a b c ...: LRU of 2 misses everything; MIN keeps two of three.
    requests = [request((i,)) for i in [0, 1, 2] * 4]
    assert replay(requests, LRU(2), 2).hits == 0
    assert offline_optimum(requests, 2).hits == brute_force(requests, 2) == 6


@pytest.mark.parametrize("name", ["chat", "rag", "scan_polluted"])
def test_no_policy_beats_min_and_min_reaches_the_compulsory_bound(name: str) -> None:
    requests = standard_traces(5, scale=0.05)[name]
    distinct = distinct_chunks(requests)
    for capacity in (max(1, distinct // 20), distinct // 4):
        optimum = offline_optimum(requests, capacity)
        for make in (LRU, ARC, S3FIFO):
            assert replay(requests, make(capacity), capacity).hits <= optimum.hits
            assert replay(requests, make(capacity), capacity, admission=SeenK(capacity)).hits <= optimum.hits
        assert optimum.hit_rate <= compulsory_bound(requests)
    assert offline_optimum(requests, distinct).hit_rate == pytest.approx(compulsory_bound(requests))


def test_min_counts_the_chunks_it_stores() -> None:
    requests = [request((0, 0)), request((0, 0)), request((1,))]
    result = offline_optimum(requests, 2)
    assert (result.lookups, result.hits, result.stored) == (5, 2, 2)  # (1,) is never used again


def test_min_needs_a_positive_capacity() -> None:
    with pytest.raises(ConfigError):
        offline_optimum([request((0,))], 0)

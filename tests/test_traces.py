"""Workload traces: seeded, prefix-structured like real chunk keys, and their replay."""

from __future__ import annotations

import random

import pytest

from tiered_kv.keys import KEY_BYTES
from tiered_kv.policies import ARC, LRU, S3FIFO, SeenK
from tiered_kv.traces import (
    CHUNK_TOKENS,
    TraceRequest,
    chat,
    distinct_chunks,
    mix,
    rag,
    replay,
    scans,
    shared_system_prompt,
    standard_traces,
)


def is_prefix(short: tuple[bytes, ...], long: tuple[bytes, ...]) -> bool:
    return long[: len(short)] == short


def request(*keys: int) -> TraceRequest:
    return TraceRequest(workload="test", keys=tuple(k.to_bytes(KEY_BYTES, "big") for k in keys), prompt_tokens=999)


def test_the_same_seed_gives_the_same_traces_and_another_seed_does_not() -> None:
    assert standard_traces(7, scale=0.1) == standard_traces(7, scale=0.1)
    assert standard_traces(7, scale=0.1)["chat"] != standard_traces(8, scale=0.1)["chat"]


def test_every_full_chunk_has_a_16_byte_key() -> None:
    for requests in standard_traces(0, scale=0.05).values():
        for req in requests:
            assert len(req.keys) == req.prompt_tokens // CHUNK_TOKENS
            assert all(len(key) == KEY_BYTES for key in req.keys)


def test_a_chat_turn_extends_an_earlier_turn_of_its_conversation() -> None:
    requests = chat(random.Random(1), requests=200, active=4, system_tokens=600)
    system = requests[0].keys[:2]  # 600 tokens: two full chunks of the shared system prompt
    assert all(is_prefix(system, req.keys) for req in requests)
    extended = sum(any(is_prefix(old.keys, req.keys) for old in requests[:i]) for i, req in enumerate(requests))
    assert extended > 100  # most turns return to a conversation seen before


def test_requests_behind_one_system_prompt_share_its_chunks_and_nothing_after() -> None:
    requests = shared_system_prompt(random.Random(2), requests=50, prompts=1)
    base = min(len(req.keys) for req in requests) - 4  # the user's message is at most 1,000 tokens
    assert all(req.keys[:base] == requests[0].keys[:base] for req in requests)
    assert len({req.keys[-1] for req in requests if len(req.keys) > base + 1}) > 1


def test_rag_documents_come_back_by_popularity() -> None:
    requests = rag(random.Random(3), requests=300, documents=50)
    assert distinct_chunks(requests) < sum(len(req.keys) for req in requests) / 3


def test_scans_never_repeat_a_chunk() -> None:
    requests = scans(random.Random(4), requests=20, min_tokens=2048, max_tokens=4096)
    assert distinct_chunks(requests) == sum(len(req.keys) for req in requests)


def test_a_salt_gives_the_same_workload_other_keys() -> None:
    one = chat(random.Random(5), requests=20)
    two = chat(random.Random(5), requests=20, salt=b"tenant-2")
    assert [req.prompt_tokens for req in one] == [req.prompt_tokens for req in two]
    assert not {key for req in one for key in req.keys} & {key for req in two for key in req.keys}


def test_mix_keeps_every_request_and_each_trace_in_order() -> None:
    first, second = [request(i) for i in range(10)], [request(100 + i) for i in range(5)]
    mixed = mix(random.Random(6), first, second)
    assert [r for r in mixed if r in first] == first and [r for r in mixed if r in second] == second


def test_replay_counts_a_prompts_leading_resident_chunks_as_hits() -> None:
    result = replay([request(1, 2, 3), request(1, 2, 3, 4)], LRU(8), 8)
    assert (result.lookups, result.hits, result.stored) == (7, 3, 4)
    assert result.hit_rate == pytest.approx(3 / 7)


def test_replay_counts_a_resident_chunk_after_a_missing_one_as_a_miss() -> None:
    policy = LRU(8)
    result = replay([request(1, 2, 3), request(9, 2, 3)], policy, 8)
    assert result.hits == 0 and result.stored == 4  # 2 and 3 are resident but follow a miss
    assert len(policy) == 4


def test_replay_never_evicts_the_chunks_of_the_prompt_it_serves() -> None:
    result = replay([request(1, 2), request(1, 2, 3, 4, 5)], LRU(3), 3)
    assert (result.hits, result.stored) == (2, 3)  # only chunk 3 fits beside 1 and 2


def test_replay_stores_only_what_the_admission_filter_lets_in() -> None:
    admission = SeenK(8, k=2)
    trace = [request(1, 2), request(1, 2), request(1, 2)]
    result = replay(trace, LRU(8), 8, admission=admission)
    assert (result.hits, result.stored) == (2, 2)  # stored on the second sighting, hit on the third


def test_on_the_scan_polluted_trace_arc_and_s3fifo_beat_lru() -> None:
    requests = standard_traces(0, scale=0.5)["scan_polluted"]
    capacity = distinct_chunks(requests) // 20
    lru, arc, s3fifo = (replay(requests, make(capacity), capacity).hit_rate for make in (LRU, ARC, S3FIFO))
    assert arc > lru and s3fifo > lru

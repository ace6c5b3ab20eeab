"""The capacity planner: curves, peers, MIN, recommendations; the recorder's traces."""

from __future__ import annotations

import hashlib
import io

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_manager_control import config, open_harness

from tiered_kv.errors import ChunkKeyError, ConfigError
from tiered_kv.optimum import compulsory_bound
from tiered_kv.peers import PEERS, replay_peer
from tiered_kv.planner import Candidate, candidates, capacity_grid, make_plan
from tiered_kv.policies import LRU
from tiered_kv.trace_file import parse_lines
from tiered_kv.trace_recorder import TraceRecorder
from tiered_kv.traces import TraceRequest, distinct_chunks, replay, standard_traces

TRACES = standard_traces(2, scale=0.05)


def request(path: tuple[int, ...]) -> TraceRequest:
    keys = tuple(hashlib.blake2b(repr(path[: i + 1]).encode(), digest_size=16).digest() for i in range(len(path)))
    return TraceRequest(workload="tree", keys=keys, prompt_tokens=len(keys))


def test_the_grid_runs_geometrically_from_the_smallest_capacity_to_the_working_set() -> None:
    assert capacity_grid(10_000, points=5, smallest=100) == [100, 316, 1000, 3162, 10_000]
    assert capacity_grid(50, points=4, smallest=256) == [50]
    assert capacity_grid(1000, points=1) == [1000]
    with pytest.raises(ConfigError):
        capacity_grid(0)


def test_a_grid_asked_for_more_points_than_capacities_stops_at_the_working_set() -> None:
    # Regression: --points 1e9 looped a billion times for a grid of at most 991 capacities.
    grid = capacity_grid(1_000, points=10**12, smallest=10)
    assert grid[0] == 10 and grid[-1] == 1_000 and len(grid) <= 991 and grid == sorted(set(grid))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=5).map(tuple), min_size=1, max_size=14))
def test_lru_never_loses_hits_as_capacity_grows(paths: list[tuple[int, ...]]) -> None:
    requests = [request(path) for path in paths]
    hits = [replay(requests, LRU(c), c).hits for c in range(1, distinct_chunks(requests) + 1)]
    assert hits == sorted(hits)


@pytest.mark.parametrize("name", ["chat", "rag", "scan_polluted"])
def test_the_planners_lru_curve_rises_with_capacity_to_the_bound(name: str) -> None:
    requests = TRACES[name]
    grid = capacity_grid(distinct_chunks(requests), points=12, smallest=8)
    plan = make_plan(name, requests, chunk_tokens=256, chunk_bytes=1, capacities=grid, policies=candidates(["lru"], []))
    (lru,) = (curve for curve in plan.curves if curve.name == "lru")
    assert lru.hit_rates == sorted(lru.hit_rates) and lru.hit_rates[0] < lru.hit_rates[-1]
    assert lru.hit_rates[-1] == pytest.approx(plan.compulsory_hit_rate) == pytest.approx(compulsory_bound(requests))


def test_a_plan_has_every_candidate_peer_and_min_and_min_is_never_beaten() -> None:
    requests = TRACES["scan_polluted"]
    grid = capacity_grid(distinct_chunks(requests), points=4, smallest=32)
    policies = candidates(["lru", "arc"], ["seen_k"])
    plan = make_plan("t", requests, chunk_tokens=256, chunk_bytes=1000, capacities=grid, policies=policies)
    assert [c.name for c in plan.curves] == ["lru", "lru+seen_k", "arc", "arc+seen_k", *(p.name for p in PEERS), "min"]
    optimum = plan.curves[-1]
    for curve in plan.curves:
        assert all(rate <= best + 1e-12 for rate, best in zip(curve.hit_rates, optimum.hit_rates, strict=True))
        tokens = sum(r.prompt_tokens for r in requests)
        assert curve.token_hit_rates[0] == pytest.approx(curve.hit_rates[0] * plan.lookups * 256 / tokens)
    assert all(name in {"lru", "lru+seen_k", "arc", "arc+seen_k"} for name in plan.best)
    assert plan.working_set_chunks == grid[-1] == distinct_chunks(requests)


def test_a_recommendation_is_the_smallest_capacity_that_reaches_its_target() -> None:
    requests = TRACES["rag"]
    grid = capacity_grid(distinct_chunks(requests), points=5, smallest=16)
    target = 0.8 * compulsory_bound(requests)
    plan = make_plan(
        "rag",
        requests,
        chunk_tokens=256,
        chunk_bytes=4096,
        capacities=grid,
        policies=candidates(["lru"], []),
        targets=[("nvme", target), ("cpu", 0.99)],
    )
    (sizing,) = plan.sizings  # 0.99 is above the bound: no size reaches it
    assert sizing.tier == "nvme" and sizing.curve == "lru" and sizing.bytes == sizing.chunks * 4096
    lru = Candidate(policy="lru")
    assert sizing.hit_rate == lru.replay(requests, sizing.chunks).hit_rate >= target
    assert lru.replay(requests, sizing.chunks - 1).hit_rate < target


def test_peers_order_chunks_without_predecessors() -> None:
    # A prompt of three chunks, then a one-off: a peer's LRU drops the prompt's head, stranding its tail.
    prompt, other = request((0, 0, 0)), request((1,))
    trace = [prompt, other, prompt]
    plain = next(peer for peer in PEERS if peer.name == "lru-plain")
    assert replay_peer(trace, plain, 3).hits == 0
    assert replay(trace, LRU(3), 3).hits == 2
    vllm = next(peer for peer in PEERS if peer.name == "vllm-lru")
    assert replay_peer(trace, vllm, 3).hits == 2  # tail to head: the head is the most recent


async def test_a_recorded_trace_replays_to_the_same_hit_rates() -> None:
    """A host records each prompt next to its lookup on a running TieredKV; the file,
    read back, gives every policy the hit rates of the traffic itself."""
    requests = TRACES["chat"][:150]
    harness = await open_harness(config(cpu_chunks=64, nvme_chunks=None))
    now = [0.0]
    sink = io.BytesIO()
    recorder = TraceRecorder(sink, chunk_tokens=256, clock=lambda: now[0])
    for i, traced in enumerate(requests):
        now[0] += 0.25
        keys = list(traced.keys)
        hit = harness.kv.lookup(harness_ns(), [keys])
        recorder.record(keys, traced.prompt_tokens, output_tokens=7)
        if hit < len(keys):
            await harness.kv.store(harness_ns(), request_id=str(i), keys=[keys], block_ids=[list(range(4 * len(keys)))])
            await harness.kv.finish_request(str(i))
    await harness.kv.close()
    assert recorder.recorded == len(requests)
    back = parse_lines(io.BytesIO(sink.getvalue()), name="recorded", block_tokens=256, chunk_tokens=256)
    assert [r.arrival_ms for r in back.requests] == [250.0 * (i + 1) for i in range(len(requests))]
    assert all(r.output_tokens == 7 for r in back.requests)
    assert b"chunk" not in sink.getvalue() and requests[0].keys[0] not in sink.getvalue()
    capacity = distinct_chunks(requests) // 8
    for candidate in candidates(["lru", "arc", "s3fifo"], ["seen_k", "seen_adaptive"]):
        assert candidate.replay(back.requests, capacity).hits == candidate.replay(requests, capacity).hits


def harness_ns():  # type: ignore[no-untyped-def]
    from test_manager_control import NS

    return NS


def test_a_recorder_forgets_old_keys_beyond_its_bound() -> None:
    sink = io.BytesIO()
    recorder = TraceRecorder(sink, chunk_tokens=16, max_keys=2)
    keys = [bytes([i]) * 16 for i in range(3)]
    recorder.record(keys[:2], 32)
    recorder.record(keys[2:], 16)
    recorder.record(keys[:1], 20)
    lines = sink.getvalue().splitlines()
    assert [line.split(b'"hash_ids":')[1] for line in lines] == [b"[0,1]}", b"[2]}", b"[3,4]}"]
    with pytest.raises(ConfigError):
        TraceRecorder(sink, chunk_tokens=0)
    with pytest.raises(ConfigError):
        recorder.record(keys, 0)


@pytest.mark.parametrize(
    "keys",
    [[b"short"], [b"k" * 17], ["a string, not bytes" * 2], [bytearray(16)], [None], [b"k" * 16, 3]],
)
def test_a_recorder_refuses_what_is_not_a_chunk_key_and_writes_nothing(keys: list[object]) -> None:
    """Regression: keys of any length or type were written as hash ids of their own."""
    sink = io.BytesIO()
    recorder = TraceRecorder(sink, chunk_tokens=16)
    with pytest.raises(ChunkKeyError):
        recorder.record(keys, 64)  # type: ignore[arg-type]
    assert sink.getvalue() == b"" and recorder.recorded == 0


def test_a_recorder_refuses_more_keys_than_the_prompt_has_chunks() -> None:
    """A line with more hash ids than its input length covers is one the reader rejects."""
    sink = io.BytesIO()
    recorder = TraceRecorder(sink, chunk_tokens=16)
    with pytest.raises(ConfigError, match="3 chunk keys for 47 tokens"):
        recorder.record([bytes([i]) * 16 for i in range(3)], 47)
    assert sink.getvalue() == b""


@pytest.mark.parametrize("reading", [float("nan"), float("inf"), -1.0])
def test_a_recorder_refuses_a_clock_reading_that_is_no_time_since_it_started(reading: float) -> None:
    """Regression: a clock that gave NaN wrote ``"timestamp": null``, a line the reader rejects."""
    readings = iter([0.0, reading])
    sink = io.BytesIO()
    recorder = TraceRecorder(sink, chunk_tokens=16, clock=lambda: next(readings))
    with pytest.raises(ConfigError, match="the clock gave"):
        recorder.record([b"k" * 16], 16)
    assert sink.getvalue() == b""

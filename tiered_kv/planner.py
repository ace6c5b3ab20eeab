"""Capacity planning: hit rate against capacity for every policy on one trace, against
the offline optimum, and the tier sizes that reach a target hit rate.

Every registered policy, alone and behind every registered admission filter, is replayed
(:func:`tiered_kv.traces.replay`, prefix semantics) at each capacity of a grid, next to
the peers' orderings (:mod:`tiered_kv.peers`), Belady's MIN (:mod:`tiered_kv.optimum`)
and the compulsory-miss bound. Hit rates are counted in chunks and in prompt tokens.

The tiers are modelled as one cache of the given size: the recommended nvme tier holds
the chunks that reach the target hit rate on its own (as write-through keeps them), the
cpu tier those that reach the cpu target. A recommendation is the smallest capacity at
which the best policy reaches a target, refined between grid points by bisection.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from tiered_kv.errors import ConfigError
from tiered_kv.optimum import MIN, compulsory_bound, offline_optimum
from tiered_kv.peers import PEERS, replay_peer
from tiered_kv.policy_factory import make_admission_filter, make_policy
from tiered_kv.traces import ReplayResult, TraceRequest, distinct_chunks, replay

#: Admission filters remember this many keys per chunk of capacity, as the manager sizes them.
ADMISSION_TABLE_PER_CHUNK = 4
#: Sightings seen_k waits for in the plan, as the manager's default.
ADMISSION_K = 2
#: Replays spent refining a recommended size between two grid points.
REFINE_STEPS = 8


class Curve(msgspec.Struct, frozen=True, kw_only=True):
    """One policy's (or reference's) hit rate at each capacity of the plan."""

    name: str
    #: ``policy`` (tiered-kv's, with its admission filter), ``peer``, or ``optimum``.
    kind: str
    hit_rates: list[float]
    token_hit_rates: list[float]


class Sizing(msgspec.Struct, frozen=True, kw_only=True):
    """The smallest capacity at which ``curve`` reaches ``target_hit_rate``."""

    tier: str
    target_hit_rate: float
    curve: str
    chunks: int
    hit_rate: float
    bytes: int


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    trace: str
    requests: int
    chunk_tokens: int
    chunk_bytes: int
    #: Chunks looked up (every full chunk of every prompt) and distinct among them.
    lookups: int
    working_set_chunks: int
    prompt_tokens: int
    #: The hit rate of an unbounded cache: no curve goes above it.
    compulsory_hit_rate: float
    capacities: list[int]
    curves: list[Curve]
    #: Per capacity, the tiered-kv curve with the highest hit rate.
    best: list[str]
    sizings: list[Sizing]


class Candidate(msgspec.Struct, frozen=True, kw_only=True):
    """A tiered-kv policy with an admission filter (or none), as the planner replays it."""

    policy: str
    admission: str | None = None
    #: Sightings the filter waits for, if it counts them.
    k: int = ADMISSION_K

    @property
    def name(self) -> str:
        return self.policy if self.admission is None else f"{self.policy}+{self.admission}"

    def replay(self, requests: Sequence[TraceRequest], capacity: int) -> ReplayResult:
        admission = (
            None
            if self.admission is None
            else make_admission_filter(self.admission, ADMISSION_TABLE_PER_CHUNK * capacity, k=self.k)
        )
        return replay(requests, make_policy(self.policy, capacity), capacity, admission=admission)


def candidates(policies: Sequence[str], admissions: Sequence[str]) -> list[Candidate]:
    """Every policy alone, then behind each admission filter."""
    return [Candidate(policy=policy, admission=admission) for policy in policies for admission in (None, *admissions)]


def capacity_grid(working_set: int, *, points: int = 10, smallest: int = 256) -> list[int]:
    """``points`` capacities spaced geometrically from ``smallest`` chunks (or the working
    set, if smaller) to the working set."""
    if working_set <= 0 or points <= 0 or smallest <= 0:
        raise ConfigError(f"needs a non-empty trace and positive sizes, got {working_set, points, smallest}")
    low = min(smallest, working_set)
    points = min(points, working_set - low + 1)  # there are no more distinct capacities
    if points == 1 or low == working_set:
        return [working_set]
    ratio = (working_set / low) ** (1 / (points - 1))
    grid = sorted({max(1, round(low * ratio**i)) for i in range(points - 1)} | {working_set})
    return grid


def make_plan(
    name: str,
    requests: Sequence[TraceRequest],
    *,
    chunk_tokens: int,
    chunk_bytes: int,
    capacities: Sequence[int],
    policies: Sequence[Candidate],
    targets: Sequence[tuple[str, float]] = (),
    progress: Callable[[int, int, str], None] = lambda index, total, what: None,
) -> Plan:
    """Replay ``requests`` for every candidate, peer and MIN at every capacity; size a tier
    for each ``(tier, target hit rate)``."""
    if not requests or not capacities:
        raise ConfigError("a plan needs requests and capacities")
    prompt_tokens = sum(request.prompt_tokens for request in requests) or 1
    runs: list[tuple[str, str, Callable[[int], ReplayResult]]] = [
        (candidate.name, "policy", lambda c, candidate=candidate: candidate.replay(requests, c))  # type: ignore[misc]
        for candidate in policies
    ]
    runs += [(peer.name, "peer", lambda c, peer=peer: replay_peer(requests, peer, c)) for peer in PEERS]  # type: ignore[misc]
    runs.append((MIN, "optimum", lambda c: offline_optimum(requests, c)))
    curves = []
    total = len(runs) * len(capacities)
    for i, (curve_name, kind, run) in enumerate(runs):
        results = []
        for j, capacity in enumerate(capacities):
            progress(i * len(capacities) + j, total, f"{curve_name} at {capacity:,} chunks")
            results.append(run(capacity))
        curves.append(
            Curve(
                name=curve_name,
                kind=kind,
                hit_rates=[r.hit_rate for r in results],
                token_hit_rates=[r.hits * chunk_tokens / prompt_tokens for r in results],
            )
        )
    progress(total, total, "done")
    ours = [curve for curve in curves if curve.kind == "policy"]
    best = [max(ours, key=lambda curve: curve.hit_rates[j]).name for j in range(len(capacities))] if ours else []
    by_name = {candidate.name: candidate for candidate in policies}
    sizings = [
        sizing
        for tier, target in targets
        if (sizing := _size(tier, target, requests, capacities, ours, by_name, chunk_bytes)) is not None
    ]
    return Plan(
        trace=name,
        requests=len(requests),
        chunk_tokens=chunk_tokens,
        chunk_bytes=chunk_bytes,
        lookups=sum(len(request.keys) for request in requests),
        working_set_chunks=distinct_chunks(requests),
        prompt_tokens=prompt_tokens,
        compulsory_hit_rate=compulsory_bound(requests),
        capacities=list(capacities),
        curves=curves,
        best=best,
        sizings=sizings,
    )


def _size(
    tier: str,
    target: float,
    requests: Sequence[TraceRequest],
    capacities: Sequence[int],
    curves: Sequence[Curve],
    by_name: dict[str, Candidate],
    chunk_bytes: int,
) -> Sizing | None:
    """The curve that reaches ``target`` at the smallest grid capacity, refined by
    bisection between that capacity and the one before; ``None`` if none reaches it, or
    if the target is 0 (a trace with no reuse), which needs no tier."""
    if target <= 0:
        return None
    reached = [
        (j, -curve.hit_rates[j], curve.name)
        for curve in curves
        for j in range(len(capacities))
        if curve.hit_rates[j] >= target
    ]
    if not reached:
        return None
    j, minus_rate, name = min(reached)
    low = capacities[j - 1] if j else 0  # below target (or nothing)
    high, rate = capacities[j], -minus_rate
    for _ in range(REFINE_STEPS):
        if high - low <= 1:
            break
        middle = (low + high) // 2
        result = by_name[name].replay(requests, middle)
        if result.hit_rate >= target:
            high, rate = middle, result.hit_rate
        else:
            low = middle
    return Sizing(tier=tier, target_hit_rate=target, curve=name, chunks=high, hit_rate=rate, bytes=high * chunk_bytes)

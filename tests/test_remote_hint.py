"""The remote residency hint: bounded, O(1) per key, corrected by what the store reports."""

from __future__ import annotations

import random

import pytest
import torch
from remote_support import chunks, empty, key, open_tier, ops, remote_config, requires_valkey, valkey

from tiered_kv.remote_hint import ResidencyHint
from tiered_kv.testing.valkey_server import ValkeyServer

__all__ = ["valkey"]  # fixture


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


A, B = "tenant-a", "tenant-b"


def likely_prefix(hint: ResidencyHint, keys: list[bytes], namespace: str = A) -> int:
    """The run of leading keys the hint believes present; where it stops, probes are queued
    (what the control plane's lookup does past the local tiers)."""
    for i, chunk in enumerate(keys):
        if not hint.likely(chunk, namespace):
            hint.probe_from(keys, i, namespace)
            return i
    return len(keys)


def test_stored_keys_form_the_likely_prefix_and_a_miss_corrects_it() -> None:
    hint = ResidencyHint(8)
    hint.note_present([k(0), k(1), k(2)], A)
    assert likely_prefix(hint, [k(0), k(1), k(2), k(3)]) == 3
    assert hint.note_absent([k(1)], A) == [k(1)]  # the load found it gone: one miss, then the hint knows
    assert likely_prefix(hint, [k(0), k(1), k(2)]) == 1
    assert hint.known_absent(k(1), A) and not hint.likely(k(1), A)
    assert hint.statistics().mistaken == 1


def test_the_least_recently_confirmed_key_is_forgotten_first() -> None:
    hint = ResidencyHint(3)
    hint.note_present([k(0), k(1), k(2)], A)
    hint.note_present([k(0)], A)  # a hit refreshes it
    hint.note_present([k(3)], A)
    assert [hint.likely(k(i), A) for i in range(4)] == [True, False, True, True]
    assert len(hint) == 3


def test_a_lookup_that_stops_at_an_unknown_key_queues_it_and_the_next_for_probing() -> None:
    hint = ResidencyHint(16, probe_ahead=3)
    hint.note_present([k(0)], A)
    assert likely_prefix(hint, [k(0), k(1), k(2), k(3), k(4)]) == 1
    assert likely_prefix(hint, [k(0), k(1), k(2), k(3), k(4)]) == 1  # asked again: queued once
    assert hint.take_probes(10) == [(k(1), A), (k(2), A), (k(3), A)]
    assert hint.take_probes(10) == []
    assert hint.statistics().probes_taken == 3


def test_a_probe_answer_extends_the_prefix_or_stops_asking_until_it_expires() -> None:
    clock = Clock()
    hint = ResidencyHint(16, absent_ttl_s=5, clock=clock)
    likely_prefix(hint, [k(0), k(1)])
    probes = hint.take_probes(10)
    assert probes == [(k(0), A), (k(1), A)]
    hint.note_present([k(0)], A)  # EXISTS said yes for k0 (another engine stored it), no for k1
    assert hint.note_absent([k(1)], A) == [], "an unknown key found absent was no mistake"
    assert likely_prefix(hint, [k(0), k(1)]) == 1
    assert hint.take_probes(10) == [], "an absent key is not probed again at once"
    clock.now = 5.0
    assert likely_prefix(hint, [k(0), k(1)]) == 1
    assert hint.take_probes(10) == [(k(1), A)], "once the absent entry expired, it is probed again"


def test_what_is_not_a_chunk_key_is_never_queued_for_a_probe() -> None:
    hint = ResidencyHint(16, probe_ahead=4)
    keys: list[object] = [k(0), "a string key", k(1)]
    hint.probe_from(keys, 0, A)  # type: ignore[arg-type]
    hint.probe_from([b"short", k(2)], 0, A)
    hint.probe_from([7, k(3)], 0, A)  # type: ignore[list-item]
    assert hint.take_probes(10) == [(k(0), A)]


def test_the_probe_queue_is_bounded_and_counts_what_it_dropped() -> None:
    hint = ResidencyHint(4, probe_capacity=3, probe_ahead=1)
    for i in range(5):
        likely_prefix(hint, [k(i)])
    assert hint.statistics().probes_pending == 3
    assert hint.statistics().probes_dropped == 2
    assert hint.take_probes(10) == [(k(2), A), (k(3), A), (k(4), A)]


def test_what_one_namespace_reports_says_nothing_about_another() -> None:
    hint = ResidencyHint(8)
    hint.note_present([k(0)], A)
    assert hint.likely(k(0), A) and not hint.likely(k(0), B), "B handed A's key learns nothing"
    assert hint.note_absent([k(0)], B) == []
    assert hint.likely(k(0), A), "B's miss on its own name for the key leaves A's entry"
    assert not hint.known_absent(k(0), A) and hint.known_absent(k(0), B)
    assert likely_prefix(hint, [k(0)], B) == 0
    assert hint.take_probes(10) == [], "B's own absent entry stops its probe"


def test_clear_forgets_everything() -> None:
    hint = ResidencyHint(4)
    hint.note_present([k(0)], A)
    hint.note_absent([k(1)], A)
    likely_prefix(hint, [k(2)])
    hint.clear()
    stats = hint.statistics()
    assert (stats.present, stats.absent, stats.probes_pending) == (0, 0, 0)


@pytest.mark.parametrize(
    "bad", [{"capacity": 0}, {"capacity": 2, "probe_capacity": 0}, {"capacity": 2, "absent_ttl_s": 0}]
)
def test_bad_sizes_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ResidencyHint(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(5))
def test_random_reports_keep_the_hint_bounded_and_agreeing_with_the_last_report(seed: int) -> None:
    rng = random.Random(seed)
    clock = Clock()
    capacity = rng.randint(1, 12)
    hint = ResidencyHint(capacity, probe_capacity=rng.randint(1, 6), probe_ahead=rng.randint(1, 4), clock=clock)
    last: dict[tuple[bytes, str], str] = {}  # (key, namespace) → its last report
    for _ in range(2000):
        keys = [k(rng.randrange(30)) for _ in range(rng.randint(1, 5))]
        namespace = rng.choice([A, A, A, B])
        action = rng.random()
        clock.now += rng.choice([0.0, 0.1, 1.0])
        if action < 0.35:
            hint.note_present(keys, namespace)
            for key in keys:
                last.update({(key, other): "overwritten" for other in (A, B) if other != namespace})
                last[key, namespace] = "present"
        elif action < 0.6:
            believed = {key for key in keys if hint.likely(key, namespace)}
            assert set(hint.note_absent(keys, namespace)) == believed
            last.update({(key, namespace): "absent" for key in keys})
        elif action < 0.9:
            n = likely_prefix(hint, keys, namespace)
            assert all(hint.likely(key, namespace) for key in keys[:n])
            assert n == len(keys) or not hint.likely(keys[n], namespace)
        else:
            for key, asked_for in hint.take_probes(rng.randint(1, 4)):
                assert not hint.likely(key, asked_for)
        stats = hint.statistics()
        assert stats.present <= capacity and stats.absent <= capacity
        assert stats.probes_pending <= hint.probe_capacity
        for (key, namespace), report in last.items():
            if report != "present":
                assert not hint.likely(key, namespace), f"a key reported {report} was still believed present"
            elif hint.likely(key, namespace):
                assert not hint.known_absent(key, namespace)


@requires_valkey
async def test_a_second_engine_finds_the_first_engines_chunks_through_probes(valkey: ValkeyServer) -> None:
    """The flow the manager runs: A stores and notes; B's lookup queues probes, one
    batched EXISTS answers them, B's next lookup sees the prefix; a vanished chunk costs
    B one miss, after which the hint knows."""
    config = remote_config(valkey)
    engine_a, engine_b = await open_tier(config), await open_tier(config)
    hint_a, hint_b = ResidencyHint(64), ResidencyHint(64)
    try:
        data = chunks(4, 64 << 10, seed=40)
        stored = await engine_a.write_each(ops(data))
        hint_a.note_present([key(i) for i, ok in enumerate(stored) if ok], A)
        wanted = [key(i) for i in range(6)]  # B's request: 4 stored chunks, then 2 nobody has
        assert likely_prefix(hint_a, wanted) == 4
        assert likely_prefix(hint_b, wanted) == 0
        probes = [probe for probe, _ in hint_b.take_probes(16)]
        for probe, present in zip(probes, await engine_b.exists(probes), strict=True):
            (hint_b.note_present if present else hint_b.note_absent)([probe], A)
        assert likely_prefix(hint_b, wanted) == 4
        assert hint_b.take_probes(16) == [], "the two absent chunks are not probed again at once"

        await engine_a.delete([key(2)])  # evicted by the server, say
        out = empty(4, 64 << 10)
        found = await engine_b.read_each(ops(out))
        assert found == [True, True, False, True]
        hint_b.note_absent([key(i) for i, ok in enumerate(found) if not ok], A)
        assert likely_prefix(hint_b, wanted) == 2
        assert all(torch.equal(out[i], data[i]) for i in (0, 1, 3))
    finally:
        await engine_a.close()
        await engine_b.close()

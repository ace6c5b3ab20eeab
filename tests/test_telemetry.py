"""The KV event queue: batches kept as they come, records built when drained."""

from __future__ import annotations

import collections
import gc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_kv.errors import TieredKVError
from tiered_kv.stats import KVEvent, KVEventKind
from tiered_kv.telemetry import Telemetry
from tiered_kv.testing import chunk_key

STORED, REMOVED = KVEventKind.STORED, KVEventKind.REMOVED


def test_events_come_out_one_per_key_oldest_first_across_batches() -> None:
    telemetry = Telemetry(100)
    telemetry.emit_many(STORED, "cpu", "a", 0, [chunk_key(1), chunk_key(2)])
    telemetry.emit(REMOVED, "nvme", "b", 1, chunk_key(3))
    assert telemetry.drain_events(2) == [
        KVEvent(kind=STORED, tier="cpu", namespace="a", group=0, key=chunk_key(1)),
        KVEvent(kind=STORED, tier="cpu", namespace="a", group=0, key=chunk_key(2)),
    ]
    assert telemetry.drain_events() == [KVEvent(kind=REMOVED, tier="nvme", namespace="b", group=1, key=chunk_key(3))]
    assert telemetry.drain_events() == []


def test_a_drain_may_end_inside_a_batch_and_the_next_one_goes_on_from_there() -> None:
    telemetry = Telemetry(100)
    telemetry.emit_many(STORED, "cpu", "a", 0, [chunk_key(i) for i in range(5)])
    assert [event.key for event in telemetry.drain_events(2)] == [chunk_key(0), chunk_key(1)]
    assert [event.key for event in telemetry.drain_events(2)] == [chunk_key(2), chunk_key(3)]
    assert [event.key for event in telemetry.drain_events()] == [chunk_key(4)]


def test_overflow_forgets_the_oldest_events_even_inside_a_batch_and_counts_them() -> None:
    telemetry = Telemetry(3)
    telemetry.emit_many(STORED, "cpu", "a", 0, [chunk_key(i) for i in range(4)])
    telemetry.emit_many(STORED, "cpu", "a", 0, [chunk_key(4)])
    assert telemetry.events_dropped == 2
    assert [event.key for event in telemetry.drain_events()] == [chunk_key(2), chunk_key(3), chunk_key(4)]


def test_with_no_room_for_events_every_one_is_counted_and_none_kept() -> None:
    telemetry = Telemetry(0)
    telemetry.emit_many(STORED, "cpu", "a", 0, [chunk_key(1), chunk_key(2)])
    assert telemetry.events_dropped == 2 and telemetry.drain_events() == []


def test_emit_each_gives_each_key_the_namespace_at_its_position() -> None:
    telemetry = Telemetry(10)
    keys = [chunk_key(i) for i in range(4)]
    telemetry.emit_each(REMOVED, "cpu", ["a", "b", "b", "a"], 0, keys)
    assert [(event.namespace, event.key) for event in telemetry.drain_events()] == list(zip("abba", keys, strict=True))


@pytest.mark.parametrize("bad", [-1, 1.5, "3"])
def test_a_bad_drain_size_is_refused(bad: object) -> None:
    with pytest.raises(TieredKVError):
        Telemetry(10).drain_events(bad)  # type: ignore[arg-type]


_emit = st.tuples(
    st.just("emit"),
    st.sampled_from([STORED, REMOVED]),
    st.lists(st.sampled_from("ab"), max_size=6),  # one namespace per key (emit_each) …
    st.booleans(),  # … or the first for all of them (emit_many)
)
_drain = st.tuples(st.just("drain"), st.none() | st.integers(0, 8))


@settings(max_examples=300, deadline=None)
@given(max_events=st.integers(0, 10), steps=st.lists(st.one_of(_emit, _drain), max_size=40))
def test_the_queue_behaves_as_a_bounded_deque_of_events(max_events: int, steps: list[tuple]) -> None:
    """Against the plainest model: a ``deque(maxlen)`` of the records, one per key."""
    telemetry = Telemetry(max_events)
    model: collections.deque[KVEvent] = collections.deque(maxlen=max_events)
    dropped = 0
    serial = 0
    for step in steps:
        if step[0] == "drain":
            wanted = step[1]
            count = len(model) if wanted is None else min(wanted, len(model))
            assert telemetry.drain_events(wanted) == [model.popleft() for _ in range(count)]
        else:
            _, kind, namespaces, one_namespace = step
            keys = [chunk_key(serial + i) for i in range(len(namespaces))]
            serial += len(keys)
            if one_namespace and namespaces:
                namespaces = [namespaces[0]] * len(namespaces)
                telemetry.emit_many(kind, "cpu", namespaces[0], 0, keys)
            else:
                telemetry.emit_each(kind, "cpu", namespaces, 0, keys)
            for namespace, key in zip(namespaces, keys, strict=True):
                dropped += len(model) == max_events
                model.append(KVEvent(kind=kind, tier="cpu", namespace=namespace, group=0, key=key))
        assert telemetry.events_dropped == dropped
    assert telemetry.drain_events() == list(model)


def test_a_batch_keeps_the_keys_it_was_given_when_the_caller_changes_its_list() -> None:
    telemetry = Telemetry(10)
    keys = [chunk_key(1), chunk_key(2)]
    telemetry.emit_many(STORED, "cpu", "a", 0, keys)
    keys[0] = chunk_key(9)
    keys.append(chunk_key(8))
    assert [event.key for event in telemetry.drain_events()] == [chunk_key(1), chunk_key(2)]


def test_the_queued_batches_are_not_tracked_by_the_garbage_collector() -> None:
    """A full queue of tracked objects would be walked by every full collection."""
    telemetry = Telemetry(100)
    telemetry.emit(STORED, "cpu", "a", 0, chunk_key(1))
    telemetry.emit_many(STORED, "cpu", "a", 0, [chunk_key(2), chunk_key(3)])
    gc.collect()  # tuples of bytes are untracked by the collection that first sees them
    assert not any(gc.is_tracked(batch) or gc.is_tracked(batch.keys) for batch in telemetry._batches)

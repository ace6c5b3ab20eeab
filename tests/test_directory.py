"""The residency index against a plain model: random reservations, completions, pins,
leases and drops over tenants; all-or-nothing eviction; nothing pinned, pending or leased
is ever evicted."""

from __future__ import annotations

import array
import random
import sys

import pytest
from structlog.testing import capture_logs

from tiered_kv._keytable import KeyInts, Protection
from tiered_kv.directory import PENDING, READY, LeaseEpoch, TierIndex
from tiered_kv.errors import PolicyError, TieredKVError
from tiered_kv.partition import TierPartition
from tiered_kv.policies import LRU

TENANTS = ["a" * 64, "b" * 64]


def make(capacity: int) -> tuple[TierIndex, LeaseEpoch]:
    partition = TierPartition("cpu", capacity)
    for tenant in TENANTS:
        partition.add_namespace(tenant, "lru")
    epoch = LeaseEpoch()
    return TierIndex("cpu", partition, epoch), epoch


@pytest.mark.parametrize("seed", range(25))
def test_the_index_agrees_with_a_model_through_random_operations(seed: int) -> None:
    rng = random.Random(seed)
    capacity = rng.randint(1, 8)
    index, epoch = make(capacity)
    universe = [i.to_bytes(16, "little") for i in range(3 * capacity)]
    #: key → [state, pins, namespace, leased in epoch]
    model: dict[bytes, list] = {}
    for _ in range(300):
        action = rng.randrange(8)
        key = rng.choice(universe)
        if action == 0:
            want = [k for k in rng.sample(universe, rng.randint(1, capacity)) if k not in model]
            tenant = rng.choice(TENANTS)
            before = dict((k, list(v)) for k, v in model.items())
            reservation = index.reserve(want, tenant)
            if reservation is None:
                assert {k: v for k, v in model.items()} == before  # nothing changed
                evictable = [k for k, v in model.items() if v[0] == READY and not v[1] and v[3] != epoch.value]
                assert len(model) + len(want) - len(evictable) > capacity
                continue
            for victim in reservation.evicted:
                state, pins, _, leased = model.pop(victim.key)
                assert state == READY and pins == 0 and leased != epoch.value, "evicted a protected chunk"
            for k in want:
                model[k] = [PENDING, 0, tenant, -1]
            assert len(set(reservation.slots.values())) == len(want)
            slots = list(reservation.slots.values())
            assert slots == sorted(slots), "keys reserved together get ascending slots"
        elif action == 1 and key in model and model[key][0] == PENDING:
            if rng.random() < 0.5:
                index.mark_ready(key)
                model[key][0] = READY
            else:  # every pending chunk at once, as a store's copy completes
                pending = [k for k, v in model.items() if v[0] == PENDING]
                assert index.mark_ready_many(pending) == [model[k][2] for k in pending]
                for k in pending:
                    model[k][0] = READY
        elif action == 2 and key in model:
            if rng.random() < 0.5:
                index.pin(key)
                model[key][1] += 1
            else:  # a copy out of the tier pins a batch and learns each one's slot, owner, namespace
                batch = rng.sample(sorted(model), rng.randint(1, len(model)))
                copies = index.pin_for_copy(batch)
                assert [(c.key, c.slot, c.owner, c.namespace) for c in copies] == [
                    (k, index.slot(k), model[k][2], model[k][2]) for k in batch
                ]
                for k in batch:
                    model[k][1] += 1
        elif action == 3 and key in model and model[key][1]:
            index.unpin(key)
            model[key][1] -= 1
        elif action == 4 and key in model and model[key][0] == READY:
            index.lease(key)
            model[key][3] = epoch.value
        elif action == 5:
            epoch.advance()
        elif action == 6 and key in model:
            if model[key][1]:
                with pytest.raises(TieredKVError):
                    index.drop(key)
            else:
                index.drop(key)
                del model[key]
        elif action == 7 and key in model and model[key][0] == READY:
            assert index.hit(key) >= 1
        index.check()
        assert len(index) == len(model) and index.used == len(model)
        assert index.pinned == sum(1 for v in model.values() if v[1])
        for k in universe:
            entry = model.get(k)
            for tenant in TENANTS:
                ready = entry is not None and entry[0] == READY and entry[2] == tenant
                assert index.ready_for(k, tenant) is ready
                assert index.state_for(k, tenant) == (entry[0] if entry is not None and entry[2] == tenant else 0)


def test_keys_reserved_together_take_the_slots_of_their_victims_in_ascending_order() -> None:
    """A prompt's chunks evicted leaves first free their slots in descending order; the
    next store's keys take them ascending, so that chunks stored together lie in
    consecutive slots (one copy for the drivers, not one per chunk)."""
    index, _ = make(8)
    old = [bytes([1, i]) * 8 for i in range(8)]
    first = index.reserve(old, TENANTS[0], parents=dict(zip(old, [None, *old[:-1]], strict=True)))
    assert first is not None
    index.mark_ready_many(first.slots)
    new = [bytes([2, i]) * 8 for i in range(8)]
    reservation = index.reserve(new, TENANTS[0], parents=dict(zip(new, [None, *new[:-1]], strict=True)))
    assert reservation is not None
    assert [victim.key for victim in reservation.evicted] == old[::-1]  # leaves first
    assert list(reservation.slots.values()) == list(range(8))


def test_a_reserved_key_must_not_be_resident_and_a_tier_without_leases_refuses_one() -> None:
    index, _ = make(2)
    key = b"k" * 16
    assert index.reserve([key], TENANTS[0]) is not None
    with pytest.raises(TieredKVError, match="already resident"):
        index.reserve([key], TENANTS[0])
    partition = TierPartition("nvme", 2)
    partition.add_namespace(TENANTS[0], "lru")
    no_leases = TierIndex("nvme", partition, count_hits=False)
    no_leases.reserve([key], TENANTS[0])
    no_leases.mark_ready(key)
    assert no_leases.hit(key) == 0
    with pytest.raises(TieredKVError, match="no leases"):
        no_leases.lease(key)
    with pytest.raises(TieredKVError, match="already ready"):
        no_leases.mark_ready_many([key])
    with pytest.raises(TieredKVError, match="not resident"):
        no_leases.mark_ready_many([b"x" * 16])
    with pytest.raises(TieredKVError, match="not resident"):
        no_leases.pin_for_copy([b"x" * 16])


def test_a_chunk_counted_in_another_share_is_read_only_by_its_own_namespace() -> None:
    index, _ = make(2)
    key = b"k" * 16
    index.reserve([key], TENANTS[0], namespace="tenant-c")
    index.mark_ready(key)
    assert index.owner(key) == TENANTS[0] and index.namespace(key) == "tenant-c"
    assert index.ready_for(key, "tenant-c") and not index.ready_for(key, TENANTS[0])
    (copy,) = index.pin_for_copy([key])
    assert (copy.owner, copy.namespace) == (TENANTS[0], "tenant-c")
    index.unpin(key)
    assert index.drop(key) >= 0
    index.check()


@pytest.mark.parametrize("takes_the_map", [True, False])
def test_a_warm_restart_in_batches_restores_every_chunk_and_then_works_as_usual(takes_the_map: bool) -> None:
    index, _ = make(8)
    chunks = KeyInts()
    chunks.update((bytes([i]) * 16, slot) for i, slot in enumerate([6, 1, 4, 0, 3]))
    keys, slots = list(chunks), list(chunks.values())
    index.begin_restore(chunks if takes_the_map else None)
    for start in range(0, len(keys), 2):
        index.restore_many(keys[start : start + 2], slots[start : start + 2], TENANTS[0])
    index.settle()
    index.check()
    assert [index.slot(key) for key in keys] == slots
    assert all(index.ready_for(key, TENANTS[0]) for key in keys)
    reserved = index.reserve([b"n" * 16, b"m" * 16], TENANTS[0])  # free slots first, nothing evicted
    assert sorted(reserved.slots.values()) == [2, 5] and reserved.evicted == []
    assert index.reserve([b"o" * 16, b"p" * 16], TENANTS[0]).evicted[0].key == keys[0]  # the oldest goes first
    index.check()


@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo"])
@pytest.mark.parametrize("takes_the_map", [True, False])
def test_a_warm_restart_that_takes_the_map_sizes_the_policys_table_once_for_what_comes(
    policy: str, takes_the_map: bool
) -> None:
    """Told how many come, the policy's table is sized for them all at once (a million
    keys' table that grows as it fills moves them meanwhile); without the map, untold.
    Either way the restart ends the same."""
    partition = TierPartition("nvme", 4096)
    partition.add_namespace(TENANTS[0], policy)
    index = TierIndex("nvme", partition, LeaseEpoch())
    chunks = KeyInts()
    chunks.set_many([i.to_bytes(16, "little") for i in range(3000)], list(range(3000)))
    keys, slots = list(chunks), list(chunks.values())
    table = {"lru": "_order", "arc": "_t1", "s3fifo": "_state"}[policy]
    before = sys.getsizeof(getattr(partition.policy(TENANTS[0]), table))
    index.begin_restore(chunks if takes_the_map else None, TENANTS[0])
    told = sys.getsizeof(getattr(partition.policy(TENANTS[0]), table))
    assert (told - before >= 3000 * 4) is takes_the_map  # buckets for all, at once
    for start in range(0, len(keys), 1000):
        index.restore_many(keys[start : start + 1000], slots[start : start + 1000], TENANTS[0])
    index.settle()
    index.check()
    assert list(partition.policy(TENANTS[0]).evict(3, lambda key: False) or ()) == keys[:3]


def test_a_restore_hint_tells_a_policy_at_most_the_tiers_capacity_and_nothing_of_an_empty_restart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    told: list[int] = []
    monkeypatch.setattr(LRU, "expect_restored", lambda self, n: told.append(n))
    partition = TierPartition("nvme", 16)
    partition.add_namespace(TENANTS[0], "lru")
    partition.expect_restored(TENANTS[0], 10**9)
    partition.expect_restored(TENANTS[0], 5)
    partition.expect_restored(TENANTS[0], 0)
    assert told == [16, 5]
    monkeypatch.delattr(LRU, "expect_restored")
    partition.expect_restored(TENANTS[0], 5)  # no longer a RestoreHintPolicy: nothing to tell
    assert told == [16, 5]
    with pytest.raises(PolicyError, match="was not added"):
        partition.expect_restored("other", 5)


@pytest.mark.parametrize("hint", [RuntimeError("hint failed"), TypeError("not a key")])
def test_a_restore_hint_that_raises_is_logged_and_the_restart_goes_on(
    monkeypatch: pytest.MonkeyPatch, hint: Exception
) -> None:
    def expect_restored(self: LRU, n: int) -> None:
        raise hint

    monkeypatch.setattr(LRU, "expect_restored", expect_restored)
    partition = TierPartition("nvme", 8)
    partition.add_namespace(TENANTS[0], "lru")
    index = TierIndex("nvme", partition, LeaseEpoch())
    chunks = KeyInts()
    chunks.set_many([b"a" * 16, b"b" * 16], [3, 5])
    with capture_logs() as logs:
        index.begin_restore(chunks, TENANTS[0])
    index.restore_many([b"a" * 16, b"b" * 16], [3, 5], TENANTS[0])
    index.settle()
    index.check()
    assert [(e["event"], e["policy"], e["error"]) for e in logs] == [("policy.restore_hint_failed", "lru", repr(hint))]
    assert index.ready_for(b"b" * 16, TENANTS[0]) and index.slot(b"b" * 16) == 5


def test_a_warm_restart_that_misses_a_batch_or_starts_on_a_used_index_is_refused() -> None:
    index, _ = make(4)
    chunks = KeyInts()
    chunks.update([(b"a" * 16, 0), (b"b" * 16, 1)])
    with pytest.raises(TieredKVError, match="without begin_restore"):
        index.restore_many(list(chunks), list(chunks.values()), TENANTS[0])
    index.begin_restore(chunks)
    index.restore_many([b"a" * 16], [0], TENANTS[0])
    with pytest.raises(TieredKVError, match="1 chunks restored of the 2"):
        index.settle()
    used, _ = make(4)
    used.reserve([b"c" * 16], TENANTS[0])
    with pytest.raises(TieredKVError, match="empty index"):
        used.begin_restore(KeyInts())


def test_a_load_pins_the_leading_run_ready_for_its_namespace_and_stops_at_the_first_other() -> None:
    index, _ = make(8)
    keys = [i.to_bytes(16, "little") for i in range(5)]
    assert index.reserve(keys[:3], TENANTS[0]) is not None
    assert index.reserve(keys[3:4], TENANTS[1]) is not None
    index.mark_ready_many(keys[:2] + keys[3:4])  # keys[2] stays PENDING
    assert index.pin_ready_run(keys[:2] + keys[3:], TENANTS[0]) == 2  # keys[3]: another tenant's
    assert index.pin_ready_run(keys, TENANTS[0]) == 2  # keys[2]: still PENDING
    assert [index.pins(key) for key in keys[:4]] == [2, 2, 0, 0] and index.pinned == 2
    assert index.pin_ready_run(keys[4:], TENANTS[0]) == 0  # not resident
    index.check()


def test_a_load_past_the_most_pins_a_chunk_counts_pins_nothing() -> None:
    index, _ = make(4)
    keys = [i.to_bytes(16, "little") for i in range(3)]
    assert index.reserve(keys, TENANTS[0]) is not None
    index.mark_ready_many(keys)
    for _ in range(65535):
        index.pin(keys[1])
    with pytest.raises(TieredKVError, match="65535 pins already"):
        index.pin_ready_run(keys, TENANTS[0])
    assert [index.pins(key) for key in keys] == [0, 65535, 0] and index.pinned == 1
    index.check()


def test_hit_counts_stop_at_the_most_they_count() -> None:
    index, _ = make(4)
    key = (1).to_bytes(16, "little")
    assert index.reserve([key], TENANTS[0]) is not None
    index.mark_ready(key)
    for _ in range(65534):
        index.hit(key)
    assert index.hit_many([key, key]) == [65535, 65535]


def test_an_eviction_passes_over_what_the_index_protects_and_nothing_else() -> None:
    index, epoch = make(8)
    keys = [i.to_bytes(16, "little") for i in range(7)]
    assert index.reserve(keys[:6], TENANTS[0]) is not None
    index.mark_ready_many(keys[:4])  # keys[4], keys[5]: PENDING
    index.pin(keys[1])
    index.lease(keys[2])
    epoch.advance()
    index.lease(keys[3])  # leased in this epoch; keys[2]'s lease has expired
    protection = Protection(index._slots, index._state, index._pins, index._lease, epoch.value, None, None, READY)
    assert [protection(key) for key in keys] == [False, True, False, True, True, True, True]  # keys[6]: absent
    keeping = Protection(index._slots, index._state, index._pins, None, -1, {keys[0]}, {keys[2]: 1}, READY)
    assert [keeping(key) for key in keys[:4]] == [True, True, True, False]  # no leases: keys[3] may go
    # READY is the index's, passed in, not a copy of it in C: with PENDING as the readable state,
    # only the PENDING chunks that are not pinned or leased may go.
    pending_ready = Protection(index._slots, index._state, index._pins, index._lease, epoch.value, None, None, PENDING)
    assert [pending_ready(key) for key in keys] == [True, True, True, True, False, False, True]
    del pending_ready
    with pytest.raises(TypeError, match="'H' items"):
        Protection(index._slots, index._state, array.array("i", [0]), None, -1, None, None, READY)
    del protection, keeping
    del index._records  # the index's own per-chunk steps hold its arrays for its life
    index._state.release()  # no buffer of it is left exported: releasing one would raise BufferError

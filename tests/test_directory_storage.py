"""The index's per-slot records (namespace numbers, predecessors, the slot allocator's
never-used slots) against a plain model, through random stores, undone stores, drops,
pins, hits and restores over tenants whose namespaces come and go."""

from __future__ import annotations

import gc
import random

import pytest

from tiered_kv.directory import PENDING, READY, LeaseEpoch, TierIndex
from tiered_kv.partition import TierPartition

OWNERS = ["a" * 64, "b" * 64]


class Chunk:
    def __init__(self, namespace: str, owner: str, parent: bytes | None) -> None:
        self.namespace, self.owner, self.parent = namespace, owner, parent
        self.state, self.pins = PENDING, 0


def recorded_parent(model: dict[bytes, Chunk], key: bytes, parent: bytes | None) -> bytes | None:
    """The predecessor the index records for ``key`` stored continuing ``parent``: one
    resident already, unless resident chunks continue an earlier copy of ``key`` (a link
    from it could close a cycle)."""
    if parent not in model or any(chunk.parent == key for chunk in model.values()):
        return None
    return parent


def check_against(index: TierIndex, model: dict[bytes, Chunk], universe: list[bytes], namespaces: set[str]) -> None:
    index.check()
    assert len(index) == len(model)
    for key in universe:
        chunk = model.get(key)
        if chunk is not None:
            assert (index.namespace(key), index.owner(key), index.parent(key)) == (
                chunk.namespace,
                chunk.owner,
                chunk.parent,
            )
            assert index.pins(key) == chunk.pins
        for namespace in namespaces:
            mine = chunk is not None and chunk.namespace == namespace
            assert index.ready_for(key, namespace) is (mine and chunk is not None and chunk.state == READY)
            assert index.state_for(key, namespace) == (chunk.state if mine and chunk is not None else 0)


@pytest.mark.parametrize("seed", range(20))
def test_namespaces_and_predecessors_agree_with_a_model_while_tenants_come_and_go(seed: int) -> None:
    rng = random.Random(seed)
    capacity = rng.randint(2, 10)
    partition = TierPartition("cpu", capacity)
    for owner in OWNERS:
        partition.add_namespace(owner, "lru")
    index = TierIndex("cpu", partition, LeaseEpoch())
    universe = [i.to_bytes(16, "little") for i in range(4 * capacity)]
    model: dict[bytes, Chunk] = {}
    first_salt, most_held = 0, 0
    seen: set[str] = set()
    for _ in range(250):
        action = rng.randrange(7)
        if action == 0 and rng.random() < 0.3:  # the oldest tenant goes, a new one comes
            first_salt += 1
        elif action <= 1:  # a store: a run of keys continuing one another, perhaps a resident one
            owner = rng.choice(OWNERS)
            namespace = f"salt-{rng.randrange(first_salt, first_salt + 3)}"
            seen.add(namespace)
            wanted = [k for k in rng.sample(universe, rng.randint(1, capacity)) if k not in model]
            mine = [k for k, c in model.items() if c.owner == owner]
            parents = {key: rng.choice([None, *mine, *wanted[:i]]) for i, key in enumerate(wanted)}
            parents = {key: parent for key, parent in parents.items() if parent != key}
            reservation = index.reserve(wanted, owner, namespace, parents=parents)
            if reservation is None:
                continue
            for victim in reservation.evicted:
                chunk = model.pop(victim.key)
                assert chunk.state == READY and not chunk.pins
                assert (victim.namespace, victim.owner, victim.parent) == (chunk.namespace, chunk.owner, chunk.parent)
            before = dict(model)
            for key in wanted:  # a predecessor is recorded only if it was resident first
                model[key] = Chunk(namespace, owner, recorded_parent(model, key, parents.get(key)))
            most_held = max(most_held, len({c.namespace for c in model.values()}))
            if rng.random() < 0.3:  # the copy failed before it began: all as it was
                index.unreserve(reservation)
                model = before
                for victim in reversed(reservation.evicted):
                    parent = recorded_parent(model, victim.key, victim.parent)
                    model[victim.key] = Chunk(victim.namespace, victim.owner, parent)
                    model[victim.key].state = READY
        elif action == 2:
            pending = [k for k, c in model.items() if c.state == PENDING]
            assert index.mark_ready_many(pending) == [model[k].namespace for k in pending]
            for key in pending:
                model[key].state = READY
        elif action == 3 and model:
            key = rng.choice(sorted(model))
            if model[key].pins:
                index.unpin(key)
                model[key].pins -= 1
            else:
                index.drop(key)
                del model[key]
        elif action == 4 and model:
            batch = rng.sample(sorted(model), rng.randint(1, len(model)))
            copies = index.pin_for_copy(batch)
            assert [(c.namespace, c.owner, c.parent) for c in copies] == [
                (model[k].namespace, model[k].owner, model[k].parent) for k in batch
            ]
            for key in batch:
                model[key].pins += 1
        elif action == 5:
            ready = [k for k, c in model.items() if c.state == READY]
            index.hit_many(ready)
            if ready:
                namespace = model[ready[0]].namespace
                run = index.ready_run(ready, namespace, 0, len(ready))
                assert all(model[k].namespace == namespace for k in ready[:run])
                assert run == len(ready) or model[ready[run]].namespace != namespace
        elif action == 6:
            for key in [k for k, c in model.items() if c.pins]:
                index.unpin(key)
                model[key].pins -= 1
        check_against(index, model, universe, seen)
        held = {c.namespace for c in model.values()}
        most_held = max(most_held, len(held))
        assert {name for name in index._namespaces.names if name is not None} == held
        assert len(index._namespaces.names) <= most_held + 1, "a namespace's number is reused once it holds nothing"


def test_a_warm_restart_keeps_the_namespaces_it_restores_and_later_slots_come_from_the_free_ones() -> None:
    partition = TierPartition("nvme", 8)
    partition.add_namespace(OWNERS[0], "lru")
    index = TierIndex("nvme", partition, count_hits=False)
    index.begin_restore()
    index.restore_many([b"a" * 16, b"b" * 16], [5, 2], OWNERS[0])
    index.settle()
    reserved = index.reserve([bytes([i]) * 16 for i in range(6)], OWNERS[0], "tenant-c")
    assert reserved is not None and sorted(reserved.slots.values()) == [0, 1, 3, 4, 6, 7]
    assert index.namespace(b"a" * 16) == OWNERS[0] and index.namespace(b"\0" * 16) == "tenant-c"
    assert index.parent(b"a" * 16) is None
    index.check()


def test_the_index_keeps_no_python_container_with_an_item_per_slot() -> None:
    """The cyclic garbage collector visits every item of a list or dict on each full pass:
    per-slot records in one would cost every pass time proportional to the tier."""
    partition = TierPartition("nvme", 50_000)
    partition.add_namespace(OWNERS[0], "lru")
    index = TierIndex("nvme", partition, count_hits=False)
    keys = [i.to_bytes(16, "little") for i in range(1000)]
    assert index.reserve(keys, OWNERS[0], parents=dict(zip(keys[1:], keys[:-1], strict=True))) is not None
    containers = [obj for obj in gc.get_referents(*gc.get_referents(index)) if isinstance(obj, (list, dict, tuple))]
    assert max(map(len, containers), default=0) < 100

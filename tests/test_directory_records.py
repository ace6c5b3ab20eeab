"""The index's per-chunk steps in C (``SlotRecords``) against the Python steps they
replaced: the same random operations on two indexes, one running the previous Python
loops, must give the same answers, errors and arrays at every step; misuse raises the
index's typed errors and changes nothing it should not; no reference is leaked."""

from __future__ import annotations

import contextlib
import functools
import random
import sys
import tracemalloc
from collections.abc import Callable, Iterable, Sequence

import msgspec
import pytest

from tiered_kv._keytable import SlotRecords
from tiered_kv.directory import _KEY_BYTES, _MAX_COUNT, FREE, PENDING, READY, LeaseEpoch, TierIndex, Victim
from tiered_kv.errors import TieredKVError
from tiered_kv.interfaces import CachePolicy
from tiered_kv.keys import ChunkKey
from tiered_kv.partition import TierPartition

OWNERS = ["a" * 64, "b" * 64]


class PythonStepsIndex(TierIndex):
    """The index with its batch steps as the Python loops they were before they went to C."""

    def _python_victims(self, victims: dict[str, list[ChunkKey]]) -> list[Victim]:
        evicted = []
        for victim_owner, victim_keys in victims.items():
            for victim in victim_keys:
                slot = self._slots.pop(victim)
                namespace = self._namespaces.names[self._namespace[slot]]
                assert namespace is not None
                evicted.append(Victim(victim, slot, victim_owner, namespace, self._parent_at(slot)))
                if self._children[slot]:  # resident chunks still continue it
                    self._orphans[victim] = self._children[slot]
        return evicted

    def mark_ready_many(self, keys: Iterable[ChunkKey]) -> list[str]:
        namespaces = []
        for key in keys:
            slot = self._require(key)
            if self._state[slot] == READY:
                raise TieredKVError(f"{self.tier}: chunk {key.hex()} is already ready")
            self._state[slot] = READY
            namespaces.append(self._namespace_at(slot))
        return namespaces

    def pin_ready_run(self, keys: Sequence[ChunkKey], namespace: str) -> int:
        n = 0
        for key in keys:
            if not self.ready_for(key, namespace):
                break
            slot = self._slots[key]
            if self._pins[slot] >= _MAX_COUNT:
                for undo in range(n):
                    self.unpin(keys[undo])
            self.pin(key)  # raises past the most pins, after the undo
            n += 1
        return n

    def slots_of(self, keys: Sequence[ChunkKey]) -> list[int]:
        return [self._require(key) for key in keys]

    def pin_for_copy(self, keys: Iterable[ChunkKey]) -> list[Victim]:
        chunks: list[Victim] = []
        try:
            for key in keys:
                slot = self.pin(key)
                namespace = self._namespace_at(slot)
                chunks.append(
                    Victim(key, slot, self._other_owner.get(slot, namespace), namespace, self._parent_at(slot))
                )
        except BaseException:
            for chunk in chunks:  # none stays pinned
                self.unpin(chunk.key)
            raise
        return chunks

    def ready_run(self, keys: Sequence[ChunkKey], namespace: str, start: int, stop: int) -> int:
        for i in range(start, stop):
            if not self.ready_for(keys[i], namespace):
                return i
        return stop

    def unpin_many(self, keys: Iterable[ChunkKey]) -> None:
        for key in keys:
            slot = self._slots.get(key)
            if slot is None or self._pins[slot] <= 0:
                raise TieredKVError(f"{self.tier}: chunk {key.hex()} is not pinned")
            self.unpin(key)

    def hit_many(self, keys: Sequence[ChunkKey]) -> list[int]:
        counts = []
        for key in keys:
            slot = self._slots[key]
            self._partition.touch(self._owner_of(slot), key)
            if self._hits is not None:
                self._hits[slot] = min(self._hits[slot] + 1, _MAX_COUNT)
                counts.append(self._hits[slot])
        return counts

    def _occupy_many(
        self,
        keys: list[ChunkKey],
        slots: list[int],
        owner: str,
        namespace: str,
        state_of_all: int,
        parent_of: Callable[[ChunkKey], ChunkKey | None],
    ) -> None:
        if not keys:
            return
        ns = self._namespaces.hold(namespace, len(keys))
        try:
            for key, slot in zip(keys, slots, strict=True):
                continued = self._orphans.get(key, 0)  # resident chunks continue an earlier copy of it
                parent = None if continued else parent_of(key)
                if parent is not None and parent not in self._slots:
                    parent = None
                if parent is not None:
                    self._parent[_KEY_BYTES * slot : _KEY_BYTES * (slot + 1)] = parent
                self._partition.insert(owner, key, parent)
                self._slots[key] = slot
                self._state[slot] = state_of_all
                self._namespace[slot] = ns
                self._has_parent[slot] = parent is not None
                if parent is not None:
                    self._children[self._slots[parent]] += 1
                if continued:
                    self._children[slot] = continued
                    del self._orphans[key]
                if owner != namespace:
                    self._other_owner[slot] = owner
        except BaseException:
            unrecorded = [slot for key, slot in zip(keys, slots, strict=True) if key not in self._slots]
            self._namespaces.release(ns, len(unrecorded))
            self._allocator.release_many(unrecorded)
            raise

    def _clear(self, slots: list[int]) -> None:
        for slot in slots:
            parent = self._parent_at(slot)
            if parent is not None:  # its predecessor counts a resident successor less
                at = self._slots.get(parent)
                if at is not None:
                    self._children[at] -= 1
                elif self._orphans[parent] > 1:
                    self._orphans[parent] -= 1
                else:
                    del self._orphans[parent]
            self._children[slot] = 0
            self._state[slot] = FREE
            self._has_parent[slot] = 0
            if self._hits is not None:
                self._hits[slot] = 0
            if self._lease is not None:
                self._lease[slot] = 0
            self._namespaces.release(self._namespace[slot], 1)
            self._namespace[slot] = 0
            self._other_owner.pop(slot, None)


class _PythonRecords:
    """Routes a :class:`PythonStepsIndex`'s eviction through its Python steps."""

    def __init__(self, index: PythonStepsIndex, records: SlotRecords[Victim]) -> None:
        self._index, self._records = index, records

    @property
    def pinned(self) -> int:
        return self._records.pinned

    @pinned.setter
    def pinned(self, value: int) -> None:
        self._records.pinned = value

    def evict(self, victims: dict[str, list[ChunkKey]]) -> tuple[list[Victim], list[int], list[int]]:
        evicted = self._index._python_victims(victims)
        slots = [victim.slot for victim in evicted]
        self._index._clear(slots)
        return evicted, slots, []  # numbers forgotten already

    def mark_ready(self, keys: Iterable[ChunkKey]) -> list[str]:
        return self._index.mark_ready_many(keys)


def make(index_type: type[TierIndex], capacity: int, policy: str, count_hits: bool) -> TierIndex:
    partition = TierPartition("cpu", capacity)
    for owner in OWNERS:
        partition.add_namespace(owner, policy)
    index = index_type("cpu", partition, LeaseEpoch(), count_hits=count_hits)
    if isinstance(index, PythonStepsIndex):
        index._records = _PythonRecords(index, index._records)  # type: ignore[assignment]
    return index


def outcome(step: Callable[[], object]) -> object:
    """What a step returns, or the type and text of what it raises."""
    try:
        result = step()
    except (TieredKVError, KeyError, ValueError) as exc:
        return type(exc), str(exc)
    if isinstance(result, list) and result and isinstance(result[0], Victim):
        return [msgspec.structs.astuple(victim) for victim in result]
    return result


def same_records(c_index: TierIndex, py_index: TierIndex) -> None:
    for index in (c_index, py_index):
        index.check()
    assert dict(c_index._slots.items()) == dict(py_index._slots.items())
    for name in ("_state", "_pins", "_hits", "_lease", "_namespace", "_has_parent", "_children"):
        mine, theirs = getattr(c_index, name), getattr(py_index, name)
        assert (mine is None and theirs is None) or bytes(mine) == bytes(theirs), name
    for key in c_index._slots:  # a free slot's predecessor bytes are never read
        assert c_index.parent(key) == py_index.parent(key)
    assert c_index._namespaces.names == py_index._namespaces.names
    assert c_index._namespaces.held_by == py_index._namespaces.held_by
    assert c_index._other_owner == py_index._other_owner
    assert c_index._orphans == py_index._orphans
    assert c_index.pinned == py_index.pinned
    assert c_index.used == py_index.used and repr(c_index.partition) == repr(py_index.partition)


def one_step(index: TierIndex, action: int, keys: list[ChunkKey], namespace: str, store: dict) -> object:
    """Random step ``action`` on ``index``: a store (perhaps undone), or a batch call."""
    if action <= 1:
        reservation = index.reserve(keys, store["owner"], namespace, parents=store["parents"], keep=store["keep"])
        if reservation is None:
            return None
        if store["undo"]:
            index.unreserve(reservation)
        return [msgspec.structs.astuple(v) for v in reservation.evicted], reservation.slots
    if action == 2:
        return index.mark_ready_many(keys)
    if action == 3:
        return index.pin_ready_run(keys, namespace)
    if action == 4:
        return index.slots_of(keys)
    if action == 5:
        return index.unpin_many(keys)
    if action == 6:
        return index.hit_many([key for key in keys if key in index])
    if action == 7:
        return index.hit_many(keys)
    if action == 8:
        start = store["start"]
        return index.ready_run(keys, namespace, min(start, len(keys)), len(keys))
    if action == 9:
        return [msgspec.structs.astuple(v) for v in index.pin_for_copy(keys)]
    return [index.drop(key) for key in keys if key in index and not index.pins(key)]


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("seed", range(12))
def test_the_c_steps_agree_with_the_python_steps_at_every_step(policy: str, seed: int) -> None:
    rng = random.Random(seed)
    capacity = rng.randint(2, 12)
    count_hits = rng.random() < 0.7
    indexes = [make(TierIndex, capacity, policy, count_hits), make(PythonStepsIndex, capacity, policy, count_hits)]
    universe = [ChunkKey(i.to_bytes(16, "little")) for i in range(4 * capacity)]
    namespaces = [*OWNERS, "salt-1", "salt-2"]
    first = indexes[0]
    for _ in range(300):
        action = rng.randrange(11)
        keys = rng.sample(universe, rng.randint(0, min(len(universe), capacity + 2)))
        namespace = rng.choice(namespaces)
        store: dict = {}
        if action <= 1:  # a store of the owner's namespace or a tenant's counted in its share
            store["owner"] = owner = rng.choice(OWNERS)
            namespace = rng.choice([owner, owner, "salt-1", "salt-2"])
            resident = list(first._slots)
            if rng.random() < 0.9:
                keys = [key for key in keys if key not in first]
            store["parents"] = {
                key: rng.choice([None, *resident, *keys[:i], rng.choice(universe)]) for i, key in enumerate(keys)
            }
            store["keep"] = set(rng.sample(resident, min(len(resident), rng.randint(0, 2))))
            store["undo"] = rng.random() < 0.2
        elif action == 2 and rng.random() < 0.7:
            keys = [key for key in first._slots if first._state[first.slot(key)] == PENDING]
        elif action == 3 and rng.random() < 0.5:  # a run READY for one namespace
            ready = [key for key in first._slots if first.ready_for(key, namespace)]
            keys = rng.sample(ready, len(ready)) + keys[:1]
        elif action == 5 and rng.random() < 0.7:
            keys = [key for key in keys if key in first and first.pins(key)]
        elif action == 8:  # a run READY for one namespace, from some position on
            ready = [key for key in first._slots if first.ready_for(key, namespace)]
            keys = rng.sample(ready, len(ready)) + keys[: rng.randint(0, 2)]
            store["start"] = rng.randint(0, 2)
        elif action == 9 and rng.random() < 0.7:  # resident keys, now and then one that is not
            keys = rng.sample(list(first._slots), min(len(first), rng.randint(0, 4))) + keys[: rng.randint(0, 1)]
        results = [outcome(functools.partial(one_step, index, action, keys, namespace, store)) for index in indexes]
        assert results[0] == results[1], action
        same_records(*indexes)


def resident_index(capacity: int = 8, policy: str = "lru") -> tuple[TierIndex, list[ChunkKey]]:
    partition = TierPartition("cpu", capacity)
    partition.add_namespace(OWNERS[0], policy)
    index = TierIndex("cpu", partition, LeaseEpoch())
    keys = [ChunkKey(i.to_bytes(16, "little")) for i in range(4)]
    assert index.reserve(keys, OWNERS[0], parents=dict(zip(keys[1:], keys[:-1], strict=True))) is not None
    return index, keys


def test_misuse_of_a_batch_raises_the_index_error_naming_the_chunk() -> None:
    index, keys = resident_index()
    absent = ChunkKey(b"z" * 16)
    with pytest.raises(TieredKVError, match=f"^cpu: chunk {absent.hex()} is not resident$"):
        index.mark_ready_many([keys[0], absent])
    assert index.is_ready(keys[0])  # the keys before it are marked, as one by one
    with pytest.raises(TieredKVError, match=f"^cpu: chunk {keys[0].hex()} is already ready$"):
        index.mark_ready_many(keys)
    with pytest.raises(TieredKVError, match=f"^cpu: chunk {absent.hex()} is not resident$"):
        index.slots_of([keys[1], absent])
    with pytest.raises(TieredKVError, match=f"^cpu: chunk {keys[1].hex()} is not pinned$"):
        index.unpin_many([keys[1]])
    with pytest.raises(TieredKVError, match=f"^cpu: chunk {absent.hex()} is not pinned$"):
        index.unpin_many([absent])
    with pytest.raises(KeyError):
        index.hit_many([absent])
    index.check()


def test_a_ready_run_stops_at_a_value_that_is_not_a_chunk_key_and_refuses_positions_outside_the_keys() -> None:
    index, keys = resident_index()
    index.mark_ready_many(keys)
    assert index.ready_run(keys, OWNERS[0], 0, 4) == 4
    assert index.ready_run(keys, OWNERS[0], 1, 3) == 3
    assert index.ready_run([keys[0], "not a key", keys[1]], OWNERS[0], 0, 3) == 1  # type: ignore[list-item]
    assert index.ready_run([keys[0], [1], keys[1]], OWNERS[0], 0, 3) == 1  # type: ignore[list-item]
    assert index.ready_run(keys, OWNERS[1], 0, 4) == 0  # another namespace's
    assert index.ready_run(keys, OWNERS[0], 2, 2) == 2
    for start, stop in ((-1, 2), (0, 5)):
        with pytest.raises(IndexError):
            index.ready_run(keys, OWNERS[0], start, stop)


def test_a_copy_pinning_a_key_not_resident_or_past_the_most_pins_leaves_none_pinned() -> None:
    index, keys = resident_index()
    absent = ChunkKey(b"z" * 16)
    with pytest.raises(TieredKVError, match=f"^cpu: chunk {absent.hex()} is not resident$"):
        index.pin_for_copy([keys[0], keys[1], absent])
    index._pins[index.slot(keys[2])] = _MAX_COUNT
    index._records.pinned += 1
    with pytest.raises(TieredKVError, match=f"^cpu: chunk {keys[2].hex()} has 65535 pins already$"):
        index.pin_for_copy(keys)
    assert [index.pins(key) for key in keys] == [0, 0, _MAX_COUNT, 0] and index.pinned == 1
    with pytest.raises(TypeError):
        index.pin_for_copy(5)  # type: ignore[arg-type]
    copies = index.pin_for_copy([keys[3], keys[3]])  # pinned once per copy
    assert [(c.key, c.slot, c.owner, c.parent) for c in copies] == [
        (keys[3], index.slot(keys[3]), OWNERS[0], keys[2])
    ] * 2
    assert index.pins(keys[3]) == 2
    index.check()


def test_a_run_pinned_past_the_most_pins_takes_its_pins_back() -> None:
    index, keys = resident_index()
    index.mark_ready_many(keys)
    index._pins[index.slot(keys[2])] = _MAX_COUNT
    index._records.pinned += 1
    with pytest.raises(TieredKVError, match=f"^cpu: chunk {keys[2].hex()} has 65535 pins already$"):
        index.pin_ready_run(keys, OWNERS[0])
    assert [index.pins(key) for key in keys] == [0, 0, _MAX_COUNT, 0] and index.pinned == 1
    index.check()


def test_a_resident_predecessor_of_the_wrong_length_is_refused_with_nothing_recorded() -> None:
    index, keys = resident_index()
    index.mark_ready_many(keys)
    short = ChunkKey(b"short")
    index.restore(short, 7, OWNERS[0])
    new = ChunkKey(b"n" * 16)
    with pytest.raises(ValueError, match="16 bytes, not 5"):
        index.reserve([new], OWNERS[0], parents={new: short})
    assert new not in index and not index.partition.contains(OWNERS[0], new)
    index.check()


def test_a_policy_that_raises_mid_batch_reserves_nothing_and_puts_the_victims_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    index, keys = resident_index(capacity=6, policy="arc")
    index.mark_ready_many(keys)
    policy_type = type(index.partition.policy(OWNERS[0]))
    insert, calls = policy_type.insert, []

    def failing(policy: CachePolicy, key: ChunkKey, parent: ChunkKey | None = None) -> None:
        calls.append(key)
        if len(calls) == 3:
            raise RuntimeError("the policy failed")
        insert(policy, key, parent)

    monkeypatch.setattr(policy_type, "insert", failing)
    new = [ChunkKey(bytes([i]) * 16) for i in range(10, 15)]
    with pytest.raises(RuntimeError, match="the policy failed"):
        index.reserve(new, OWNERS[0], "tenant-c")
    index.check()
    assert not any(key in index for key in new) and all(index.is_ready(key) for key in keys)
    assert [index.parent(key) for key in keys] == [None, *keys[:-1]]
    assert index._namespaces.id_of("tenant-c") == 0  # its number was forgotten with its last chunk
    assert len(calls) == 3 + 3  # the victims went back through the policy
    monkeypatch.undo()
    assert index.reserve(new, OWNERS[0], "tenant-c") is not None
    index.check()


def test_the_records_refuse_arrays_of_the_wrong_type_or_size() -> None:
    index, _ = resident_index()
    arrays = [
        index._state,
        index._pins,
        index._hits,
        index._lease,
        index._namespace,
        index._parent,
        index._has_parent,
        index._children,
    ]
    rest = (index._namespaces.names, index._namespaces.held_by, {}, {}, Victim, "cpu", TieredKVError, READY)
    SlotRecords(index._slots, *arrays, *rest)
    for at, wrong, error in [
        (1, index._state, TypeError),  # u8 pins
        (4, index._pins, TypeError),  # u16 namespaces
        (5, index._has_parent, ValueError),  # a byte of predecessor per slot
        (7, index._pins, TypeError),  # u16 successor counts
        (2, memoryview(bytes(2 * len(index._state))).cast("H"), ValueError),  # read-only hits
    ]:
        with pytest.raises(error):
            SlotRecords(index._slots, *arrays[:at], wrong, *arrays[at + 1 :], *rest)
    with pytest.raises(TypeError):
        SlotRecords({}, *arrays, *rest)  # type: ignore[arg-type]


def test_the_batch_steps_leak_no_reference_and_no_memory() -> None:
    capacity = 64
    partition = TierPartition("cpu", capacity)
    partition.add_namespace(OWNERS[0], "arc")
    index = TierIndex("cpu", partition, LeaseEpoch())
    first = ChunkKey(b"f" * 16)
    before = sys.getrefcount(first)

    def cycle(start: int) -> None:
        keys = [first, *(ChunkKey((start + i).to_bytes(16, "little")) for i in range(15))]
        reserved = index.reserve(
            keys, OWNERS[0], f"tenant-{start % 3}", parents=dict(zip(keys[1:], keys, strict=False))
        )
        assert reserved is not None
        index.mark_ready_many(keys)
        assert index.pin_ready_run(keys, f"tenant-{start % 3}") == len(keys)
        index.slots_of(keys)
        index.hit_many(keys)
        index.unpin_many(keys)
        index.pin_for_copy(keys)
        index.unpin_many(keys)
        with contextlib.suppress(TieredKVError):
            index.pin_for_copy([*keys, ChunkKey(b"z" * 16)])
        for bad in (index.mark_ready_many, index.unpin_many, lambda ks: index.pin_ready_run(ks, OWNERS[0])):
            with contextlib.suppress(TieredKVError):
                bad(keys)
        for key in keys:
            index.drop(key)

    for start in range(0, 200, 16):
        cycle(start)
    assert sys.getrefcount(first) == before
    tracemalloc.start()
    try:
        cycle(0)
        grown = tracemalloc.get_traced_memory()[0]
        for start in range(0, 20_000, 16):
            cycle(start)
        assert tracemalloc.get_traced_memory()[0] - grown < 64 * 1024
    finally:
        tracemalloc.stop()
    assert sys.getrefcount(first) == before and len(index) == 0
    index.check()

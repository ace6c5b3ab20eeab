"""The residency index of one tier of one pool: key → slot, owner, state and pins.

Synchronous and consistent at every ``await`` of its callers: a chunk is PENDING while
bytes move into its slot and READY once they are all there; only READY chunks are hits,
and only unpinned READY chunks can be evicted. Eviction is all-or-nothing: making room
for n chunks either frees n victims or changes nothing.

The tier's slots are shared by the namespaces (tenants) of the pool through a
:class:`~tiered_kv.partition.TierPartition`: each namespace has its own policy instance
and, optionally, a quota of chunks another namespace's traffic cannot take.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import NamedTuple

from tiered_kv.errors import TieredKVError
from tiered_kv.keys import ChunkKey
from tiered_kv.partition import TierPartition
from tiered_kv.slots import SlotAllocator


class State(enum.Enum):
    PENDING = "pending"
    READY = "ready"


class Residency:
    """Where one chunk lives in one tier, the namespace it belongs to (the only one that
    may read it), and which namespace's share it counts in (the same one, unless that
    namespace had no share of its own: see ``TieredKV``'s ``max_tenants``)."""

    __slots__ = ("hits", "lease", "namespace", "owner", "pins", "slot", "state")

    def __init__(self, slot: int, owner: str, namespace: str) -> None:
        self.slot = slot
        self.owner = owner
        self.namespace = namespace
        self.state = State.PENDING
        self.pins = 0
        self.hits = 0
        #: The lease epoch in which the chunk was last leased (see :class:`LeaseEpoch`).
        self.lease = -1

    def __repr__(self) -> str:
        return (
            f"Residency(slot={self.slot}, owner={self.owner[:8]}, state={self.state.value}, "
            f"pins={self.pins}, hits={self.hits})"
        )


class LeaseEpoch:
    """The current step of an engine that answers a lookup in one call and plans the load
    in a later one: a chunk leased in the current epoch is not evicted, and advancing the
    epoch ends every lease at once."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def advance(self) -> None:
        self.value += 1


class Victim(NamedTuple):
    key: ChunkKey
    slot: int
    owner: str
    namespace: str


class Reservation:
    """Slots taken for new chunks (PENDING) and the victims evicted to make room."""

    __slots__ = ("evicted", "slots")

    def __init__(self, slots: dict[ChunkKey, int], evicted: list[Victim]) -> None:
        self.slots = slots
        self.evicted = evicted


class TierIndex:
    """Keys resident in one tier: slots, owners, PENDING/READY state, pins, and the
    per-namespace eviction order and quotas of the tier's partition."""

    def __init__(self, tier: str, partition: TierPartition, epoch: LeaseEpoch | None = None) -> None:
        self.tier = tier
        self._epoch = epoch if epoch is not None else LeaseEpoch()
        self._allocator = SlotAllocator(partition.capacity)
        self._entries: dict[ChunkKey, Residency] = {}
        self._partition = partition
        self._pinned = 0

    # -- reading -----------------------------------------------------------------------
    @property
    def partition(self) -> TierPartition:
        return self._partition

    @property
    def num_slots(self) -> int:
        return self._allocator.num_slots

    @property
    def used(self) -> int:
        return self._allocator.used

    @property
    def pinned(self) -> int:
        """Chunks with at least one pin."""
        return self._pinned

    def get(self, key: ChunkKey) -> Residency | None:
        return self._entries.get(key)

    def owner(self, key: ChunkKey) -> str:
        """The namespace whose share ``key`` counts in."""
        return self._require(key).owner

    def is_ready(self, key: ChunkKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.state is State.READY

    def ready_for(self, key: ChunkKey, namespace: str) -> bool:
        """Whether ``key`` is READY and belongs to ``namespace``: a tenant handed another
        tenant's keys gets a miss, never its bytes."""
        entry = self._entries.get(key)
        return entry is not None and entry.state is State.READY and entry.namespace == namespace

    def namespace(self, key: ChunkKey) -> str:
        """The namespace ``key`` belongs to."""
        return self._require(key).namespace

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    # -- deciding ----------------------------------------------------------------------
    def reserve(self, keys: Iterable[ChunkKey], owner: str, namespace: str | None = None) -> Reservation | None:
        """PENDING slots for ``keys`` (none of them resident) of ``namespace`` (default:
        ``owner``), counted in ``owner``'s share, evicting unpinned READY chunks the
        partition allows; ``None``, changing nothing, when there is no room."""
        namespace = owner if namespace is None else namespace
        wanted = list(dict.fromkeys(keys))
        for key in wanted:
            if key in self._entries:
                raise TieredKVError(f"{self.tier}: chunk {key.hex()} is already resident")
        victims = self._partition.make_room(owner, len(wanted), self._is_protected)
        if victims is None:
            return None
        evicted = []
        for victim_owner, victim_keys in victims.items():
            for victim in victim_keys:
                entry = self._entries.pop(victim)
                self._allocator.release(entry.slot)
                evicted.append(Victim(victim, entry.slot, victim_owner, entry.namespace))
        slots = self._allocator.allocate(len(wanted))
        if slots is None:  # pragma: no cover - make_room made exactly enough room
            raise TieredKVError(f"{self.tier}: allocator lost track of free slots")
        reserved = dict(zip(wanted, slots, strict=True))
        for key, slot in reserved.items():
            self._entries[key] = Residency(slot, owner, namespace)
            self._partition.insert(owner, key)
        return Reservation(reserved, evicted)

    def unreserve(self, reservation: Reservation) -> None:
        """Undo a reservation before anything was copied: drop its PENDING chunks and put
        its victims back (their bytes are still in their slots). Their hit counts and
        recency start over."""
        for key in reservation.slots:
            self.drop(key)
        for victim in reservation.evicted:
            self.restore(victim.key, victim.slot, victim.owner, victim.namespace)

    def _is_protected(self, key: ChunkKey) -> bool:
        entry = self._entries.get(key)
        return entry is None or entry.pins > 0 or entry.state is not State.READY or entry.lease == self._epoch.value

    # -- applying ----------------------------------------------------------------------
    def mark_ready(self, key: ChunkKey) -> None:
        entry = self._require(key)
        if entry.state is State.READY:
            raise TieredKVError(f"{self.tier}: chunk {key.hex()} is already ready")
        entry.state = State.READY

    def drop(self, key: ChunkKey) -> int:
        """Forget an unpinned chunk (a failed write, or an explicit removal); its slot."""
        entry = self._require(key)
        if entry.pins:
            raise TieredKVError(f"{self.tier}: chunk {key.hex()} is pinned ({entry.pins})")
        del self._entries[key]
        self._partition.remove(entry.owner, key)
        self._allocator.release(entry.slot)
        return entry.slot

    def restore(self, key: ChunkKey, slot: int, owner: str, namespace: str | None = None) -> None:
        """Record a READY chunk of ``namespace`` (default: ``owner``) already held in
        ``slot`` (warm restart)."""
        if key in self._entries:
            raise TieredKVError(f"{self.tier}: chunk {key.hex()} is already resident")
        self._allocator.claim(slot)
        entry = Residency(slot, owner, owner if namespace is None else namespace)
        self._entries[key] = entry
        entry.state = State.READY
        self._partition.insert(owner, key)

    def hit(self, key: ChunkKey) -> int:
        """Count a hit on a READY chunk; the new hit count."""
        entry = self._require(key)
        entry.hits += 1
        self._partition.touch(entry.owner, key)
        return entry.hits

    def lease(self, key: ChunkKey) -> None:
        """Keep ``key`` from eviction until the epoch advances."""
        self._require(key).lease = self._epoch.value

    def pin(self, key: ChunkKey) -> int:
        entry = self._require(key)
        if not entry.pins:
            self._pinned += 1
        entry.pins += 1
        return entry.slot

    def unpin(self, key: ChunkKey) -> None:
        entry = self._require(key)
        if entry.pins <= 0:
            raise TieredKVError(f"{self.tier}: chunk {key.hex()} is not pinned")
        entry.pins -= 1
        if not entry.pins:
            self._pinned -= 1

    def _require(self, key: ChunkKey) -> Residency:
        entry = self._entries.get(key)
        if entry is None:
            raise TieredKVError(f"{self.tier}: chunk {key.hex()} is not resident")
        return entry

    def check(self) -> None:
        """Raise if the index contradicts itself (used by tests after every step)."""
        slots = [entry.slot for entry in self._entries.values()]
        if len(set(slots)) != len(slots):
            raise TieredKVError(f"{self.tier}: two chunks share a slot")
        if len(slots) != self._allocator.used:
            raise TieredKVError(f"{self.tier}: {len(slots)} chunks but {self._allocator.used} slots used")
        if self._partition.used != len(self._entries):
            raise TieredKVError(
                f"{self.tier}: {len(self._entries)} chunks but the partition counts {self._partition.used}"
            )
        for key, entry in self._entries.items():
            if not self._partition.contains(entry.owner, key):
                raise TieredKVError(f"{self.tier}: chunk {key.hex()} is missing from its owner's policy")
        if any(entry.pins < 0 for entry in self._entries.values()):
            raise TieredKVError(f"{self.tier}: negative pin count")
        if self._pinned != sum(1 for entry in self._entries.values() if entry.pins):
            raise TieredKVError(f"{self.tier}: pinned-chunk count is off")

"""The residency index of one tier of one pool: key → slot, state and pins.

Synchronous and consistent at every ``await`` of its callers: a chunk is PENDING while
bytes move into its slot and READY once they are all there; only READY chunks are hits,
and only unpinned READY chunks can be evicted. Eviction is all-or-nothing: making room
for n chunks either frees n victims or changes nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator

from tiered_kv.errors import TieredKVError
from tiered_kv.interfaces import CachePolicy
from tiered_kv.keys import ChunkKey
from tiered_kv.slots import SlotAllocator


class State(enum.Enum):
    PENDING = "pending"
    READY = "ready"


class Residency:
    """Where one chunk lives in one tier."""

    __slots__ = ("hits", "pins", "slot", "state")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.state = State.PENDING
        self.pins = 0
        self.hits = 0

    def __repr__(self) -> str:
        return f"Residency(slot={self.slot}, state={self.state.value}, pins={self.pins}, hits={self.hits})"


class Reservation:
    """Slots taken for new chunks (PENDING) and the victims evicted to make room."""

    __slots__ = ("evicted", "slots")

    def __init__(self, slots: dict[ChunkKey, int], evicted: list[tuple[ChunkKey, int]]) -> None:
        self.slots = slots
        self.evicted = evicted


class TierIndex:
    """Keys resident in one tier: slots, PENDING/READY state, pins, and the eviction order."""

    def __init__(self, tier: str, num_slots: int, policy: CachePolicy) -> None:
        self.tier = tier
        self._allocator = SlotAllocator(num_slots)
        self._entries: dict[ChunkKey, Residency] = {}
        self._policy = policy
        self._pinned = 0

    # -- reading -----------------------------------------------------------------------
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

    def is_ready(self, key: ChunkKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.state is State.READY

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> Iterator[tuple[ChunkKey, Residency]]:
        return iter(self._entries.items())

    # -- deciding ----------------------------------------------------------------------
    def reserve(self, keys: Iterable[ChunkKey], *, evict: bool = True) -> Reservation | None:
        """PENDING slots for ``keys`` (none of them resident), evicting unpinned READY
        chunks when needed; ``None``, changing nothing, when there is no room."""
        wanted = list(dict.fromkeys(keys))
        for key in wanted:
            if key in self._entries:
                raise TieredKVError(f"{self.tier}: chunk {key.hex()} is already resident")
        shortfall = len(wanted) - self._allocator.free
        evicted: list[tuple[ChunkKey, int]] = []
        if shortfall > 0:
            if not evict:
                return None
            victims = self._policy.evict(shortfall, self._is_protected)
            if victims is None:
                return None
            for victim in victims:
                entry = self._entries.pop(victim)
                self._allocator.release(entry.slot)
                evicted.append((victim, entry.slot))
        slots = self._allocator.allocate(len(wanted))
        if slots is None:  # pragma: no cover - the eviction above made exactly enough room
            raise TieredKVError(f"{self.tier}: allocator lost track of free slots")
        reserved = dict(zip(wanted, slots, strict=True))
        for key, slot in reserved.items():
            self._entries[key] = Residency(slot)
        return Reservation(reserved, evicted)

    def _is_protected(self, key: ChunkKey) -> bool:
        entry = self._entries.get(key)
        return entry is None or entry.pins > 0 or entry.state is not State.READY

    # -- applying ----------------------------------------------------------------------
    def mark_ready(self, key: ChunkKey) -> None:
        entry = self._require(key)
        if entry.state is State.READY:
            raise TieredKVError(f"{self.tier}: chunk {key.hex()} is already ready")
        entry.state = State.READY
        self._policy.insert(key)

    def drop(self, key: ChunkKey) -> int:
        """Forget an unpinned chunk (a failed write, or an explicit removal); its slot."""
        entry = self._require(key)
        if entry.pins:
            raise TieredKVError(f"{self.tier}: chunk {key.hex()} is pinned ({entry.pins})")
        del self._entries[key]
        if entry.state is State.READY:
            self._policy.remove(key)
        self._allocator.release(entry.slot)
        return entry.slot

    def restore(self, key: ChunkKey, slot: int) -> None:
        """Record a READY chunk already held in ``slot`` (warm restart)."""
        if key in self._entries:
            raise TieredKVError(f"{self.tier}: chunk {key.hex()} is already resident")
        self._allocator.claim(slot)
        entry = Residency(slot)
        self._entries[key] = entry
        entry.state = State.READY
        self._policy.insert(key)

    def hit(self, key: ChunkKey) -> int:
        """Count a hit on a READY chunk; the new hit count."""
        entry = self._require(key)
        entry.hits += 1
        self._policy.touch(key)
        return entry.hits

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
        ready = sum(1 for entry in self._entries.values() if entry.state is State.READY)
        if ready != len(self._policy):
            raise TieredKVError(f"{self.tier}: {ready} ready chunks but the policy orders {len(self._policy)}")
        if any(entry.pins < 0 for entry in self._entries.values()):
            raise TieredKVError(f"{self.tier}: negative pin count")
        if self._pinned != sum(1 for entry in self._entries.values() if entry.pins):
            raise TieredKVError(f"{self.tier}: pinned-chunk count is off")

"""Slot allocation for one tier: which slot indices are free, all-or-nothing."""

from __future__ import annotations

import array
from collections.abc import Sequence

import numpy as np

from tiered_kv.errors import TieredKVError

_TAKEN = -1


class SlotAllocator:
    """Free-list of ``num_slots`` slot indices; :meth:`allocate` takes n or none.

    Every operation costs O(1) per slot, :meth:`claim` too: a warm restart claims each
    recovered slot in turn. Two compact integer arrays, the free list and each slot's
    place in it, keep 8 bytes per slot (16 past 2**31 slots).
    """

    __slots__ = ("_at", "_dtype", "_free", "_unsettled", "num_slots")

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        typecode, dtype = ("i", np.int32) if num_slots < 2**31 else ("q", np.int64)
        self._dtype = dtype
        self._unsettled = False
        # Popped from the end: low slot numbers are handed out first (a claim moves the
        # last free slot into the claimed one's place).
        descending = np.arange(num_slots - 1, -1, -1, dtype=dtype).tobytes()
        self._free = array.array(typecode, descending)
        #: Where each free slot is in ``_free``; ``_TAKEN`` for a slot in use.
        self._at = array.array(typecode, descending)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` free slots, or ``None`` (and nothing taken) when fewer are free."""
        if self._unsettled:
            raise TieredKVError("slots were claimed in bulk: settle() first")
        if n > len(self._free):
            return None
        if n <= 0:
            return []
        taken = self._free[-n:].tolist()[::-1]
        del self._free[-n:]
        for slot in taken:
            self._at[slot] = _TAKEN
        return taken

    def claim(self, slot: int) -> None:
        """Take a specific slot (the slot already holds a chunk)."""
        if self._unsettled:
            raise TieredKVError("slots were claimed in bulk: settle() first")
        if not 0 <= slot < self.num_slots or self._at[slot] == _TAKEN:
            raise TieredKVError(f"slot {slot} is not free")
        place, last = self._at[slot], self._free[-1]
        self._free[place] = last
        self._at[last] = place
        self._free.pop()
        self._at[slot] = _TAKEN

    def claim_many(self, slots: Sequence[int]) -> None:
        """Take specific slots in bulk (a warm restart's batches): marked taken at once, the
        free list rebuilt only by :meth:`settle`, so that a restore of N slots costs O(N) in
        numpy rather than O(N) Python steps. Until then, nothing may be allocated."""
        at = np.frombuffer(self._at, dtype=self._dtype)
        index = np.asarray(slots, dtype=np.int64)
        if not index.size:
            return
        if index.min() < 0 or index.max() >= self.num_slots or (at[index] == _TAKEN).any():
            raise TieredKVError("a claimed slot is not free, or not a slot")
        # A slot named twice keeps only the later of two distinct marks: read them back
        # (no sort), and put the slots back as they were if one is missing.
        before = at[index]
        marks = np.arange(index.size, dtype=self._dtype)
        at[index] = marks
        if not np.array_equal(at[index], marks):
            at[index] = before
            raise TieredKVError("a slot is claimed twice")
        at[index] = _TAKEN
        self._unsettled = True

    def settle(self) -> None:
        """Rebuild the free list after :meth:`claim_many`: the slots not taken, lowest
        handed out first."""
        at = np.frombuffer(self._at, dtype=self._dtype)
        free = np.flatnonzero(at != _TAKEN)[::-1].astype(self._dtype)
        self._free = array.array(self._free.typecode, free.tobytes())
        at[free] = np.arange(free.size, dtype=self._dtype)
        self._unsettled = False

    def release(self, slot: int) -> None:
        if self._unsettled:
            raise TieredKVError("slots were claimed in bulk: settle() first")
        if not 0 <= slot < self.num_slots or self._at[slot] != _TAKEN:
            raise TieredKVError(f"slot {slot} is not allocated")
        self._at[slot] = len(self._free)
        self._free.append(slot)

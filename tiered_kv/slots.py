"""Slot allocation for one tier: which slot indices are free, all-or-nothing."""

from __future__ import annotations

from tiered_kv.errors import TieredKVError


class SlotAllocator:
    """Free-list of ``num_slots`` slot indices; :meth:`allocate` takes n or none."""

    __slots__ = ("_free", "_is_free", "num_slots")

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        # Pop from the end: low slot numbers are handed out first.
        self._free = list(range(num_slots - 1, -1, -1))
        self._is_free = bytearray(b"\x01" * num_slots)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` free slots, or ``None`` (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        taken = [self._free.pop() for _ in range(n)]
        for slot in taken:
            self._is_free[slot] = 0
        return taken

    def claim(self, slot: int) -> None:
        """Take a specific slot (warm restart: the slot already holds a chunk)."""
        if not 0 <= slot < self.num_slots or not self._is_free[slot]:
            raise TieredKVError(f"slot {slot} is not free")
        self._is_free[slot] = 0
        self._free.remove(slot)

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or self._is_free[slot]:
            raise TieredKVError(f"slot {slot} is not allocated")
        self._is_free[slot] = 1
        self._free.append(slot)

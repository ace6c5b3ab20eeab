"""Slot allocation for one tier: which slot indices are free, all-or-nothing."""

from __future__ import annotations

import array
from collections.abc import Iterator, Sequence

import numpy as np

from tiered_kv.errors import TieredKVError
from tiered_kv.zeroed import zeroed

#: A slot's place in the free list, as kept: 0 for a slot in use (or never used) …
_TAKEN = 0
#: … and -1 for one claimed in bulk, until settle().
_CLAIMED = -1
#: Slots :meth:`SlotAllocator.settling` looks at in one step (about 0.3 ms).
SETTLE_STEP = 1 << 16


class SlotAllocator:
    """Free slots among ``num_slots`` slot indices; :meth:`allocate` takes n or none.

    Slots from ``top`` on were never used: they are free without being listed, so that
    a tier of a million slots is set up in O(1) rather than by writing a million list
    entries while the loop waits. Slots released below ``top`` go into a free list,
    handed out (most recently released first) before new ones; each slot's place in it
    lets :meth:`claim` take a specific slot in O(1), as a warm restart claims each
    recovered slot in turn. About 4 bytes per slot (8 past 2**31 slots), plus 4 (8) per
    slot in the free list.
    """

    __slots__ = ("_at", "_dtype", "_free", "_top", "_torn", "_unsettled", "num_slots")

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        typecode, dtype = ("i", np.int32) if num_slots < 2**31 - 1 else ("q", np.int64)
        self._dtype = dtype
        self._unsettled = False
        #: A :meth:`settling` was stopped part way: which slots are free is lost.
        self._torn = False
        #: Slots from here on were never used.
        self._top = 0
        #: Released slots below ``_top``, popped from the end.
        self._free = array.array(typecode)
        #: One more than each listed slot's place in ``_free`` (``_TAKEN``: not listed).
        #: Its pages are touched only as slots are used.
        self._at = zeroed(num_slots, dtype)

    @property
    def free(self) -> int:
        return len(self._free) + self.num_slots - self._top

    @property
    def used(self) -> int:
        return self.num_slots - self.free

    def allocate(self, n: int) -> list[int] | None:
        """``n`` free slots, or ``None`` (and nothing taken) when fewer are free."""
        self._require_settled()
        if n > self.free:
            return None
        if n <= 0:
            return []
        listed = min(n, len(self._free))
        taken = self._free[len(self._free) - listed :].tolist()[::-1]
        del self._free[len(self._free) - listed :]
        at = self._at
        for slot in taken:
            at[slot] = _TAKEN
        top = self._top
        self._top = top + n - listed
        taken += range(top, self._top)
        return taken

    def claim(self, slot: int) -> None:
        """Take a specific slot (the slot already holds a chunk)."""
        self._require_settled()
        if not 0 <= slot < self.num_slots or (slot < self._top and self._at[slot] == _TAKEN):
            raise TieredKVError(f"slot {slot} is not free")
        if slot >= self._top:  # the never-used slots it skips are listed, lowest last
            skipped = np.arange(slot - 1, self._top - 1, -1, dtype=self._dtype)
            start = len(self._free)
            self._free.frombytes(skipped.tobytes())
            np.frombuffer(self._at, dtype=self._dtype)[skipped] = np.arange(start + 1, len(self._free) + 1)
            self._top = slot + 1
            return
        place, last = self._at[slot] - 1, self._free[-1]
        self._free[place] = last
        self._at[last] = place + 1
        self._free.pop()
        self._at[slot] = _TAKEN

    def claim_many(self, slots: Sequence[int] | np.ndarray) -> None:
        """Take specific slots in bulk (a warm restart's batches): marked taken at once, the
        free list rebuilt only by :meth:`settle`, so that a restore of N slots costs O(N) in
        numpy rather than O(N) Python steps. Until then, nothing may be allocated."""
        at = np.frombuffer(self._at, dtype=self._dtype)
        index = np.asarray(slots, dtype=np.int64)
        if not index.size:
            return
        if index.min() < 0 or index.max() >= self.num_slots:
            raise TieredKVError("a claimed slot is not a slot")
        if (((index < self._top) & (at[index] == _TAKEN)) | (at[index] == _CLAIMED)).any():
            raise TieredKVError("a claimed slot is not free")
        # A slot named twice keeps only the later of two distinct marks: read them back
        # (no sort), and put the slots back as they were if one is missing.
        before = at[index]
        marks = np.arange(1, index.size + 1, dtype=self._dtype)
        at[index] = marks
        if not np.array_equal(at[index], marks):
            at[index] = before
            raise TieredKVError("a slot is claimed twice")
        at[index] = _CLAIMED
        self._unsettled = True

    def settle(self) -> None:
        """Rebuild the free list after :meth:`claim_many`: the slots not taken, lowest
        handed out first; the slots past the last taken one are never-used again."""
        for _ in self.settling():
            pass

    def settling(self, step: int = SETTLE_STEP) -> Iterator[None]:
        """:meth:`settle` ``step`` slots at a time, from the highest down, yielding between
        steps: a warm restart's loop gives the event loop back between them (one pass
        over a million slots holds it for about 5 ms). Nothing may be allocated until
        the last step is done; one stopped part way (the generator closed) leaves the
        allocator unusable, since the marks it rewrote no longer tell claimed slots from
        never-used ones."""
        self._require_whole()
        if not self._unsettled:
            return
        settled = False
        try:
            yield from self._settle_steps(step)
            settled = True
        finally:
            self._torn = not settled

    def _settle_steps(self, step: int) -> Iterator[None]:
        at = np.frombuffer(self._at, dtype=self._dtype)
        old_top, top = self._top, None
        free_list = array.array(self._free.typecode)  # filled a step at a time, in place at the end
        for stop in range(self.num_slots, 0, -step):
            start = max(0, stop - step)
            marks = at[start:stop]
            taken = marks == _CLAIMED
            if start < old_top:
                taken[: old_top - start] |= marks[: old_top - start] == _TAKEN
            if top is None:  # still above every taken slot: these are never-used again
                last = np.flatnonzero(taken)[-1:]
                if not last.size:
                    marks[:] = _TAKEN
                    yield
                    continue
                top = start + int(last[0]) + 1
                taken = taken[: top - start]
                marks[top - start :] = _TAKEN
            free = np.flatnonzero(~taken)[::-1] + start
            marks[: len(taken)] = _TAKEN
            at[free] = np.arange(len(free_list) + 1, len(free_list) + free.size + 1)
            free_list.frombytes(free.astype(self._dtype).data.cast("B"))
            yield
        self._free = free_list
        self._top = top or 0
        self._unsettled = False

    def release(self, slot: int) -> None:
        self.release_many((slot,))

    def release_many(self, slots: Sequence[int]) -> None:
        """:meth:`release` each of ``slots``, in order."""
        self._require_settled()
        at, free, top = self._at, self._free, self._top
        for slot in slots:
            if not 0 <= slot < top or at[slot] != _TAKEN:
                raise TieredKVError(f"slot {slot} is not allocated")
            free.append(slot)
            at[slot] = len(free)

    def _require_settled(self) -> None:
        self._require_whole()
        if self._unsettled:
            raise TieredKVError("slots were claimed in bulk: settle() first")

    def _require_whole(self) -> None:
        if self._torn:
            raise TieredKVError("a settle was stopped part way: which slots are free is lost")

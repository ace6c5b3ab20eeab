"""A bounded FIFO of keys a policy has recently evicted ("ghosts").

ARC and S3-FIFO remember the keys they evicted, without their bytes, so that a key
coming back soon can be recognised. Membership is a ``set`` and age a ``deque``: a ghost
hit removes the key from the set at once and leaves its queue entry behind, to be
dropped when it reaches the front (or by a compaction once such entries outnumber the
live ones). That keeps every operation O(1) amortised and the memory near 40 bytes per
ghost, about a third of an ``OrderedDict``'s.

One imprecision is accepted: a key evicted again while its old, dead entry is still
queued leaves the ghost when that old entry comes up, a little early. Ghosts are hints,
so this costs a little hit rate at most, never correctness.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from tiered_kv.keys import ChunkKey

#: Dead entries tolerated beyond twice the live ones before the queue is compacted.
_SLACK = 64


class GhostQueue(set[ChunkKey]):
    """At most ``limit`` keys, oldest first; adding beyond the limit forgets the oldest.

    The queue *is* its set of live keys, so that ``key in ghosts``, ``len(ghosts)`` and
    ``bool(ghosts)`` — a policy asks one of them on every insert — cost no Python call.
    A key taken out with a plain ``set`` method (``discard``, ``remove``) leaves a dead
    entry, as :meth:`hit` does; keys must come in through :meth:`add` only.
    """

    __slots__ = ("_order", "limit")

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self._order: deque[ChunkKey] = deque()

    def __repr__(self) -> str:
        return f"<GhostQueue {len(self)}/{self.limit}>"

    def __reduce__(self) -> tuple[Any, ...]:
        """Copies and pickles rebuild the queue from its limit and live keys, oldest first
        (``set``'s own would pass the keys as the limit)."""
        return _rebuilt, (self.limit, [key for key in dict.fromkeys(self._order) if key in self])

    def add(self, key: ChunkKey) -> None:
        """Remember ``key`` as the newest ghost, forgetting the oldest beyond the limit.

        A key that is already a ghost keeps its place.
        """
        if key in self:
            return
        set.add(self, key)
        self._order.append(key)
        while len(self) > self.limit and self._order:  # keys put in by set's own methods have no entry
            self.pop_oldest()

    def hit(self, key: ChunkKey) -> bool:
        """Forget ``key``; true if it was a ghost (a ghost hit)."""
        if key not in self:
            return False
        set.remove(self, key)
        if len(self._order) > 2 * len(self) + _SLACK:
            self._compact()
        return True

    def pop_oldest(self) -> None:
        """Forget the oldest ghost, if there is one."""
        order = self._order
        while order:
            key = order.popleft()
            if key in self:
                set.remove(self, key)
                return

    def _compact(self) -> None:
        """Drop dead entries, keeping each live key's newest entry."""
        newest: dict[ChunkKey, None] = {}
        for key in reversed(self._order):
            if key in self and key not in newest:
                newest[key] = None
        self._order = deque(reversed(newest))


def _rebuilt(limit: int, keys: list[ChunkKey]) -> GhostQueue:
    ghosts = GhostQueue(limit)
    for key in keys:
        ghosts.add(key)
    return ghosts

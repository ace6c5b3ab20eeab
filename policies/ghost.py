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

from tiered_kv.keys import ChunkKey

#: Dead entries tolerated beyond twice the live ones before the queue is compacted.
_SLACK = 64


class GhostQueue:
    """At most ``limit`` keys, oldest first; adding beyond the limit forgets the oldest."""

    __slots__ = ("_keys", "_order", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._keys: set[ChunkKey] = set()
        self._order: deque[ChunkKey] = deque()

    def __len__(self) -> int:
        return len(self._keys)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __repr__(self) -> str:
        return f"<GhostQueue {len(self._keys)}/{self.limit}>"

    def add(self, key: ChunkKey) -> None:
        """Remember ``key`` as the newest ghost, forgetting the oldest beyond the limit.

        A key that is already a ghost keeps its place.
        """
        keys = self._keys
        if key in keys:
            return
        keys.add(key)
        self._order.append(key)
        while len(keys) > self.limit:
            self.pop_oldest()

    def discard(self, key: ChunkKey) -> bool:
        """Forget ``key``; true if it was a ghost (a ghost hit)."""
        keys = self._keys
        if key not in keys:
            return False
        keys.remove(key)
        if len(self._order) > 2 * len(keys) + _SLACK:
            self._compact()
        return True

    def pop_oldest(self) -> None:
        """Forget the oldest ghost, if there is one."""
        keys, order = self._keys, self._order
        while order:
            key = order.popleft()
            if key in keys:
                keys.remove(key)
                return

    def _compact(self) -> None:
        """Drop dead entries, keeping each live key's newest entry."""
        newest: dict[ChunkKey, None] = {}
        for key in reversed(self._order):
            if key in self._keys and key not in newest:
                newest[key] = None
        self._order = deque(reversed(newest))

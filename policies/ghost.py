"""A bounded FIFO of keys a policy has recently evicted ("ghosts").

ARC and S3-FIFO remember the keys they evicted, without their bytes, so that a key
coming back soon can be recognised. The ghosts are a :class:`~tiered_kv._keytable.KeyOrder`,
oldest first: adding, a ghost hit and forgetting the oldest are each one O(1) step, with
no step proportional to the queue (a table of a million ghosts never compacts or
rehashes all at once, which held the event loop for 290 ms when this was a ``set`` and a
``deque`` of entries left behind by hits), 40 bytes an entry, outside the cyclic garbage
collector. The order is exact: a key evicted again starts over as the newest ghost.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from tiered_kv._keytable import KeyOrder
from tiered_kv.keys import ChunkKey

_ABSENT = object()


class GhostQueue:
    """At most ``limit`` keys, oldest first; adding beyond the limit forgets the oldest."""

    __slots__ = ("_keys", "has", "limit", "size")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._keys = KeyOrder()
        #: ``key in ghosts`` and ``len(ghosts)`` as one C call each (a policy asks them on
        #: every insert).
        self.has: Callable[[object], bool] = self._keys.__contains__
        self.size: Callable[[], int] = self._keys.__len__

    @property
    def table(self) -> KeyOrder:
        """The ghosts, oldest first, as the table itself (for a policy's steps in C)."""
        return self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[ChunkKey]:
        return iter(self._keys)

    def __repr__(self) -> str:
        return f"<GhostQueue {len(self._keys)}/{self.limit}>"

    def __reduce__(self) -> tuple[Any, ...]:
        """Copies and pickles rebuild the queue from its limit and its ghosts, oldest first."""
        return _rebuilt, (self.limit, list(self._keys))

    def add(self, key: ChunkKey) -> None:
        """Remember ``key`` as the newest ghost, forgetting the oldest beyond the limit.

        A key that is already a ghost keeps its place.
        """
        keys = self._keys
        if key in keys:
            return
        keys[key] = None
        while len(keys) > self.limit and keys:  # a limit below 0 keeps nothing, as 0 does
            keys.popitem(last=False)

    def hit(self, key: ChunkKey) -> bool:
        """Forget ``key``; true if it was a ghost (a ghost hit)."""
        return self._keys.pop(key, _ABSENT) is not _ABSENT

    def pop_oldest(self) -> None:
        """Forget the oldest ghost, if there is one."""
        if self._keys:
            self._keys.popitem(last=False)


def _rebuilt(limit: int, keys: list[ChunkKey]) -> GhostQueue:
    ghosts = GhostQueue(limit)
    for key in keys:
        ghosts.add(key)
    return ghosts

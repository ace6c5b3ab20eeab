"""Admission after k sightings: store a chunk only once it has been seen k times.

Most chunks of a long one-off document are seen once; storing them costs a copy and
pushes out chunks that will be read again. Counting sightings in a bounded table, and
admitting a key on its k-th, keeps such chunks out of the tier at the price of k - 1
misses for chunks that do come back.
"""

from __future__ import annotations

from collections import OrderedDict

from tiered_kv.checks import is_int_at_least
from tiered_kv.errors import PolicyError
from tiered_kv.keys import ChunkKey
from tiered_kv.policies._checks import check_capacity


class SeenK:
    """Admits a key on its ``k``-th sighting among the ``capacity`` most recently seen keys.

    The counting table is an ``OrderedDict`` from least to most recently seen key; when
    it is full, the key seen longest ago is forgotten, with its count. An admitted key
    leaves the table: it is then resident, and if it is later evicted it must be seen
    ``k`` times again. ``k = 1`` admits everything and keeps no table.
    """

    name = "seen_k"
    __slots__ = ("_counts", "capacity", "k")

    def __init__(self, capacity: int, *, k: int = 2) -> None:
        self.capacity = check_capacity(capacity)
        if not is_int_at_least(k, 1):
            raise PolicyError(f"k must be a positive number of sightings, got {k!r}")
        self.k = k
        self._counts: OrderedDict[ChunkKey, int] = OrderedDict()

    def __len__(self) -> int:
        """Keys currently counted (at most ``capacity``)."""
        return len(self._counts)

    def __repr__(self) -> str:
        return f"<SeenK k={self.k} counted={len(self._counts)}/{self.capacity}>"

    def admit(self, key: ChunkKey, parent: ChunkKey | None = None) -> bool:
        counts = self._counts
        seen = counts.pop(key, 0) + 1
        if seen >= self.k:
            return True
        counts[key] = seen
        if len(counts) > self.capacity:
            counts.popitem(last=False)
        return False

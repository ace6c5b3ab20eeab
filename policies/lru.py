"""Least recently used: the baseline every other policy is measured against."""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable

from tiered_kv.policies._checks import check_capacity, check_count, duplicate, missing

from tiered_kv.keys import ChunkKey


class LRU:
    """Evicts the key whose last insert or touch is oldest.

    One ``OrderedDict`` from least to most recently used: a touch is ``move_to_end``, an
    eviction walks from the front past protected keys. ``clock`` and ``rng`` are accepted
    for the common constructor and unused: LRU is deterministic.
    """

    name = "lru"
    __slots__ = ("_order", "capacity")

    def __init__(
        self, capacity: int, *, clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None
    ) -> None:
        self.capacity = check_capacity(capacity)
        self._order: OrderedDict[ChunkKey, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __repr__(self) -> str:
        return f"<LRU {len(self._order)}/{self.capacity}>"

    def insert(self, key: ChunkKey) -> None:
        order = self._order
        if key in order:
            raise duplicate(key)
        order[key] = None

    def touch(self, key: ChunkKey) -> None:
        try:
            self._order.move_to_end(key)
        except KeyError:
            raise missing(key) from None

    def remove(self, key: ChunkKey) -> None:
        try:
            del self._order[key]
        except KeyError:
            raise missing(key) from None

    def evict(self, n: int, protected: Callable[[ChunkKey], bool]) -> list[ChunkKey] | None:
        """The ``n`` least recently used unprotected keys, or ``None`` changing nothing.

        Costs O(n + p) for p protected keys passed over at the old end; a failure has
        looked at every key.
        """
        check_count(n)
        if n == 0:
            return []
        order = self._order
        victims: list[ChunkKey] = []
        for key in order:
            if not protected(key):
                victims.append(key)
                if len(victims) == n:
                    break
        else:
            return None
        for key in victims:
            del order[key]
        return victims

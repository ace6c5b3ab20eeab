"""Least recently used: the baseline every other policy is measured against."""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable

from tiered_kv.policies._checks import check_capacity, check_count, duplicate, missing
from tiered_kv.policies.prefix import LeafWalk, PrefixLinks, Victims

from tiered_kv.keys import ChunkKey


class LRU:
    """Evicts the key whose last insert or touch is oldest, leaves of the prefix tree first.

    One ``OrderedDict`` from least to most recently used: a touch is ``move_to_end``, an
    eviction walks from the front past protected keys and keys whose successors are
    still resident (see :mod:`tiered_kv.policies.prefix`). ``clock`` and ``rng`` are
    accepted for the common constructor and unused: LRU is deterministic.
    """

    name = "lru"
    __slots__ = ("_links", "_order", "capacity")

    def __init__(
        self, capacity: int, *, clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None
    ) -> None:
        self.capacity = check_capacity(capacity)
        self._order: OrderedDict[ChunkKey, None] = OrderedDict()
        self._links = PrefixLinks()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __repr__(self) -> str:
        return f"<LRU {len(self._order)}/{self.capacity}>"

    def insert(self, key: ChunkKey, parent: ChunkKey | None = None) -> None:
        order = self._order
        if key in order:
            raise duplicate(key)
        self._links.link(key, parent)
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
        self._links.unlink(key)

    def evict(self, n: int, protected: Callable[[ChunkKey], bool]) -> list[ChunkKey] | None:
        """The ``n`` least recently used keys that may go, or ``None`` changing nothing.

        A key freed by the victims (its last resident successor taken) is older than the
        walk's position and goes next. Costs O(n + p) for p keys passed over (protected,
        or with resident successors) at the old end; a failure has looked at every key.
        """
        check_count(n)
        if n == 0:
            return []
        order, links = self._order, self._links
        if n == 1:
            key = links.first_leaf(order, protected)
            if key is None:
                return None
            del order[key]
            links.unlink(key)
            return [key]
        if n > len(order):
            return None
        victims = Victims(links, protected)
        walk = LeafWalk(order, victims)
        while len(victims) < n:
            key = walk.next()
            if key is None:
                return None
            freed = victims.take(key)
            if freed is not None:
                walk.freed(freed)
        for key in victims.keys:
            del order[key]
            links.unlink(key)
        return victims.keys

"""Least recently used: the baseline every other policy is measured against."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import cast

from tiered_kv._keytable import KeyOrder
from tiered_kv.keys import ChunkKey
from tiered_kv.policies._checks import add_new, check_capacity, check_count
from tiered_kv.policies.prefix import InsertStep, PrefixLinks, batch_insert

#: Marks "not in the order" where a predecessor (a key or ``None``) is expected.
_ABSENT = cast("ChunkKey | None", object())


class LRU:
    """Evicts the key whose last insert or touch is oldest, leaves of the prefix tree first.

    One :class:`~tiered_kv._keytable.KeyOrder` from least to most recently used,
    mapping each key to its predecessor: a touch is ``move_to_end``, an eviction walks
    from the front past protected keys, and parks keys whose successors are still resident (see
    :mod:`tiered_kv.policies.prefix`) until they leave, when the parked key returns to
    the front. ``clock`` and ``rng`` are accepted for the common constructor and unused:
    LRU is deterministic.
    """

    name = "lru"
    __slots__ = ("_links", "_lists", "_order", "capacity")

    def __init__(
        self, capacity: int, *, clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None
    ) -> None:
        self.capacity = check_capacity(capacity)
        self._order = KeyOrder()
        self._links = PrefixLinks(self._release)
        self._lists = self._links.lists((self._order,), (0,))

    def touch(self, key: ChunkKey) -> None:
        """A hit makes ``key`` the most recently used (parked or not). In C."""
        self._lists.touch(key)

    def __len__(self) -> int:
        return len(self._order) + self._links.parked()

    def __contains__(self, key: object) -> bool:
        return key in self._order or self._links.is_parked(key)

    def __repr__(self) -> str:
        return f"<LRU {len(self)}/{self.capacity} parked={self._links.parked()}>"

    def insert(self, key: ChunkKey, parent: ChunkKey | None = None) -> None:
        """A key becomes resident, the most recently used. In C."""
        self._lists.lru_insert(key, parent)

    def inserter(self) -> InsertStep:
        """:meth:`insert`'s C step, positional (see :func:`~tiered_kv.policies.prefix.batch_insert`)."""
        return batch_insert(self, _INSERT, self._lists.lru_insert)

    def insert_many(self, keys: Sequence[ChunkKey]) -> None:
        add_new(self._order, keys, None, self._links.is_parked)

    def expect_restored(self, n: int) -> None:
        self._order.reserve(n)

    def clear_in_steps(self) -> Iterator[None]:
        """Forget every key, a step at a time (a closing manager's); empty after the first."""
        yield from self._links.clear_in_steps(self._order)

    def remove(self, key: ChunkKey) -> None:
        self._links.unlink(key, self._take_out(key))

    def _take_out(self, key: ChunkKey) -> ChunkKey | None:
        """Drop ``key`` from the order, or from the parked keys; its predecessor."""
        parent = self._order.pop(key, _ABSENT)
        return self._links.take_parked(key) if parent is _ABSENT else parent

    def _park(self, keys: list[ChunkKey]) -> None:
        """Take keys whose successors are resident out of the order until they leave."""
        order, park = self._order, self._links.park
        for key in keys:
            park(key, 0, order.pop(key))

    def _release(self, key: ChunkKey, place: int, parent: ChunkKey | None) -> None:
        order = self._order
        order[key] = parent
        order.move_to_end(key, last=False)

    def evict(self, n: int, protected: Callable[[ChunkKey], bool]) -> list[ChunkKey] | None:
        """The ``n`` least recently used keys that may go, or ``None`` changing nothing.

        A key set free by the victims (its last resident successor taken) is older than
        the walk's position and goes next. Costs O(n + p) for p keys passed over at the
        old end (protected, or parked for their successors); a failure has looked at
        every key.
        """
        order, links = self._order, self._links
        if n == 1:  # the common case, without the bookkeeping of many victims
            key, passed = links.first_leaf(order, protected)
            if key is None:
                return None
            if passed:
                self._park(passed)
            parent = order.pop(key)
            if parent is not None:
                links.unlink(key, parent)
            return [key]
        check_count(n)
        if n == 0:
            return []
        if n > len(self):
            return None
        victims: list[ChunkKey] | None = self._lists.evict(n, protected)  # the same walk, in C
        return victims


#: LRU's own insert, which :meth:`LRU.inserter` stands in for while not replaced.
_INSERT = LRU.insert

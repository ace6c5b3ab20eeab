"""ARC: Adaptive Replacement Cache (Megiddo and Modha, FAST 2003).

Resident keys live in T1 (seen once recently) or T2 (seen at least twice); keys evicted
from them are remembered in the ghost lists B1 and B2. A ghost hit in B1 says recency
was undervalued and raises the target size of T1; one in B2 lowers it. Eviction takes
T1's least recently used key while T1 is above its target, else T2's. The result
resists one-off scans (they pass through T1 only) and adapts between recency- and
frequency-friendly workloads without a tuning knob.

Victims are the leaves of the prefix tree (see :mod:`tiered_kv.policies.prefix`): a key
whose successors are still resident is parked out of T1 or T2 until they are gone, and
then returns to the old end of its list.

Two departures from the paper follow from the owner's protocol. The owner evicts before
it inserts, so a ghost hit adapts the target on the insert that follows the eviction
and the victim choice cannot use the incoming key (the paper's tie-break "x in B2 and
|T1| = p" is dropped). And ghost lists are trimmed on insert of a new key, as in the
paper's case IV, while eviction only moves victims into them.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import cast

from tiered_kv._keytable import KeyOrder
from tiered_kv.keys import ChunkKey
from tiered_kv.policies._checks import add_new, check_capacity, check_count, check_new, missing
from tiered_kv.policies.ghost import GhostQueue
from tiered_kv.policies.prefix import InsertStep, PrefixLinks, batch_insert

#: Where a key lives, for parking: T1 (seen once recently) or T2 (seen at least twice).
_T1, _T2 = 1, 2
#: Marks "not in this list" where a predecessor (a key or ``None``) is expected.
_ABSENT = cast("ChunkKey | None", object())


class ARC:
    """Adaptive replacement between recency (T1) and frequency (T2), with ghost lists.

    T1 and T2 are :class:`~tiered_kv._keytable.KeyOrder` tables (least recently used
    first, each key mapped to its predecessor); B1 and B2 are :class:`GhostQueue`s.
    Resident keys plus ghosts never exceed ``2 * capacity``. The per-key steps of stores
    and loads, :meth:`insert`, :meth:`touch` and the eviction of many keys, run in C over
    the same tables (:class:`~tiered_kv._keytable.PrefixLists`, which also holds the target).
    ``clock`` and ``rng`` are accepted for the common constructor and unused.
    """

    name = "arc"
    __slots__ = ("_b1", "_b2", "_capacity", "_links", "_lists", "_t1", "_t2")

    def __init__(
        self, capacity: int, *, clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None
    ) -> None:
        self._capacity = check_capacity(capacity)
        self._t1 = KeyOrder()
        self._t2 = KeyOrder()
        self._b1 = GhostQueue(capacity)
        self._b2 = GhostQueue(capacity)
        self._links = PrefixLinks(self._release, places=3)
        self._lists = self._links.lists(
            (self._t1, self._t2),
            (_T1, _T2),
            ghosts=(self._b1.table, self._b2.table),
            ghost_limit=capacity,
            capacity=capacity,
        )

    @property
    def capacity(self) -> int:
        """Chunks the policy orders at most; fixed, since its C steps size the ghost lists by it."""
        return self._capacity

    def insert(self, key: ChunkKey, parent: ChunkKey | None = None) -> None:
        """A key becomes resident: a ghost hit adapts the target and goes to T2; a new key
        goes to T1 and trims the ghosts (case IV). In C."""
        self._lists.arc_insert(key, parent)

    def inserter(self) -> InsertStep:
        """:meth:`insert`'s C step, positional (see :func:`~tiered_kv.policies.prefix.batch_insert`)."""
        return batch_insert(self, _INSERT, self._lists.arc_insert)

    def touch(self, key: ChunkKey) -> None:
        """A hit makes ``key`` the newest of T2 (from T1, or parked). In C."""
        self._lists.touch(key)

    def clear_in_steps(self) -> Iterator[None]:
        """Forget every key and ghost, a step at a time (a closing manager's); empty, its
        target back at 0, after the first."""
        self._lists.target = 0.0
        yield from self._links.clear_in_steps(self._t1, self._t2, self._b1.table, self._b2.table)

    @property
    def target(self) -> float:
        """How many resident keys ARC currently wants in T1 (the recency side), 0..capacity."""
        return self._lists.target

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2) + self._links.parked()

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2 or self._links.is_parked(key)

    def __repr__(self) -> str:
        return (
            f"<ARC {len(self)}/{self.capacity} t1={self._t1_size()} t2={len(self._t2) + self._links.parked(_T2)}"
            f" b1={len(self._b1)} b2={len(self._b2)} target={self._lists.target:.1f} parked={self._links.parked()}>"
        )

    def _t1_size(self) -> int:
        return len(self._t1) + self._links.parked(_T1)

    def insert_many(self, keys: Sequence[ChunkKey]) -> None:
        if self._b1.size() or self._b2.size():  # a key may be a ghost, which insert moves to T2
            check_new(keys, self.__contains__)
            for key in keys:
                self.insert(key)
            return
        add_new(self._t1, keys, None, self._links.is_parked, self._t2)

    def expect_restored(self, n: int) -> None:
        self._t1.reserve(n)  # where insert_many puts keys that are no ghosts

    def remove(self, key: ChunkKey) -> None:
        self._links.unlink(key, self._take_out(key)[1])

    def _take_out(self, key: ChunkKey) -> tuple[int, ChunkKey | None]:
        """Drop ``key`` from T1, T2 or the parked keys: where it was, and its predecessor."""
        parent = self._t1.pop(key, _ABSENT)
        if parent is not _ABSENT:
            return _T1, parent
        parent = self._t2.pop(key, _ABSENT)
        if parent is not _ABSENT:
            return _T2, parent
        parked = self._links.unpark(key)
        if parked is None:
            raise missing(key)
        return parked

    def _release(self, key: ChunkKey, place: int, parent: ChunkKey | None) -> None:
        keys = self._t1 if place == _T1 else self._t2
        keys[key] = parent
        keys.move_to_end(key, last=False)

    def evict(self, n: int, protected: Callable[[ChunkKey], bool]) -> list[ChunkKey] | None:
        """``n`` keys that may go, by ARC's replacement rule, moved to the ghost lists.

        Victims are chosen by walking T1 and T2 from their old ends (in C for more
        than one, :meth:`PrefixLinks.lists`), and only then removed, so a failure
        changes nothing. Costs O(n + p) for p keys passed over
        (protected, or parked for their successors); a failure has looked at every key.
        """
        check_count(n)
        if n == 0:
            return []
        if n > len(self):
            return None
        if n == 1:
            return self._evict_one(protected)
        victims: list[ChunkKey] | None = self._lists.evict(n, protected)
        return victims

    def _evict_one(self, protected: Callable[[ChunkKey], bool]) -> list[ChunkKey] | None:
        """:meth:`evict` of one key: the same rule without the bookkeeping of many."""
        first_leaf = self._links.first_leaf
        in_t1 = self._t1_size()
        places = (_T1, _T2) if in_t1 > 0 and in_t1 > self._lists.target else (_T2, _T1)
        for place in places:
            key, passed = first_leaf(self._t1 if place == _T1 else self._t2, protected)
            if key is not None:
                if passed:
                    self._park(passed, place)
                self._to_ghost(key)
                return [key]
        return None

    def _park(self, keys: list[ChunkKey], place: int) -> None:
        """Take keys whose successors are resident out of their list until they leave."""
        listed, park = self._t1 if place == _T1 else self._t2, self._links.park
        for key in keys:
            park(key, place, listed.pop(key))

    def _to_ghost(self, key: ChunkKey) -> None:
        """Move victim ``key`` from its list (or its parking place) to the matching ghost list."""
        place, parent = self._take_out(key)
        (self._b1 if place == _T1 else self._b2).add(key)
        self._links.unlink(key, parent)


#: ARC's own insert, which :meth:`ARC.inserter` stands in for while not replaced.
_INSERT = ARC.insert

"""Prefix links, so that every policy evicts the leaves of the prefix tree first.

A chunk is useful only while every chunk before it in its prompt is resident: a policy
that drops a prefix's head keeps its tail resident but unreachable. Each policy here
therefore takes a key as a victim only once no resident key names it as predecessor,
and otherwise follows its own order — descendants first, leaves before their ancestors,
as a radix-tree cache evicts.

:class:`PrefixLinks` holds the edges: each key's predecessor and how many resident keys
continue each key (a count kept for absent predecessors too, so a predecessor that
arrives after its successors finds them). A key that reaches the old end of its
policy's order while it still has successors is *parked*: taken out of the order, so
that later evictions do not walk past it again, and put back at the old end (the next
to go) when its last successor leaves. An eviction chooses its victims without changing
anything, so that a policy commits them only when all ``n`` were found: LRU and ARC walk
their lists in C (:meth:`PrefixLinks.lists`, :class:`~tiered_kv._keytable.PrefixLists`),
S3-FIFO its queues with :class:`Victims`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from tiered_kv._keytable import KeyInts, KeyOrder, PrefixLists
from tiered_kv.errors import PolicyError
from tiered_kv.interfaces import CachePolicy
from tiered_kv.keys import ChunkKey
from tiered_kv.policies._checks import missing
from tiered_kv.release import cleared, emptied

#: ``release(key, place, parent)``: put a parked key back at the old end of list ``place``.
Release = Callable[[ChunkKey, int, "ChunkKey | None"], None]
#: ``insert(key, parent)``, positional: a policy's insert step for a batch caller.
InsertStep = Callable[[ChunkKey, "ChunkKey | None"], None]


def batch_insert(policy: CachePolicy, own: object, step: InsertStep) -> InsertStep:
    """What a policy over :class:`~tiered_kv._keytable.PrefixLists` hands a batch caller
    (:class:`~tiered_kv.interfaces.BatchInsertPolicy`): its C ``step`` while its
    ``insert`` is still its ``own`` function bound to itself, else that ``insert`` (a
    subclass, or a patch of the class or of the instance, replaced it)."""
    insert = policy.insert
    mine = getattr(insert, "__func__", None) is own and getattr(insert, "__self__", None) is policy
    return step if mine else insert


class PrefixLinks:
    """Resident successors per key, and the parked keys of one policy.

    The policy keeps each key's predecessor itself (usually as the value of the table
    that orders its keys) and names it here on :meth:`link` and :meth:`unlink`; a parked
    key's predecessor is kept here while it is out of the policy's lists. The counts are
    a :class:`~tiered_kv._keytable.KeyInts`: as many as the resident keys, and growing
    without a full rehash. ``release`` is called when a parked key loses its last
    successor, with the list (``place``, the policy's own numbering) it was parked from.
    """

    __slots__ = ("_parked", "_parked_at", "_release", "_successors", "_walks", "is_parked")

    def __init__(self, release: Release, places: int = 1) -> None:
        self._successors = KeyInts()
        self._parked: dict[ChunkKey, tuple[int, ChunkKey | None]] = {}
        self._parked_at = [0] * places
        self._release = release
        self.is_parked: Callable[[object], bool] = self._parked.__contains__
        #: The C walks over these links (:meth:`lists`), which hold the parked dict too.
        self._walks: list[PrefixLists] = []

    def clear_in_steps(self, *tables: KeyInts | KeyOrder) -> Iterator[None]:
        """Forget every link and parked key, and clear the policy's ``tables`` with them,
        a step at a time from the first (see :func:`tiered_kv.release.cleared`). The
        parked keys move to a new, empty dict at once (after a churn, nearly every
        resident key of a prefix tree is parked: a million of them took 40 ms to free in
        one step) and the old one is emptied a step at a time, last."""
        parked, self._parked = self._parked, {}
        self.is_parked = self._parked.__contains__
        for walk in self._walks:
            walk.swap_parked(self._parked)
        self._parked_at[:] = [0] * len(self._parked_at)
        yield from cleared(*tables, self._successors)
        yield from emptied(parked)

    def parked(self, place: int | None = None) -> int:
        """Parked keys (from list ``place``, or from all)."""
        return len(self._parked) if place is None else self._parked_at[place]

    def link(self, key: ChunkKey, parent: ChunkKey | None) -> None:
        """Count resident ``key`` as a successor of ``parent``; call before the key counts
        as resident, so that a bad parent changes nothing."""
        if parent is None:
            return
        if parent == key:
            raise PolicyError(f"key {key.hex()} cannot be its own predecessor")
        successors = self._successors
        successors[parent] = successors.get(parent, 0) + 1

    def unlink(self, key: ChunkKey, parent: ChunkKey | None) -> None:
        """``key``, a successor of ``parent``, is no longer resident (nor parked); its
        predecessor, if parked and now without successors, is released."""
        if parent is None:
            return
        left = self._successors[parent] - 1
        if left:
            self._successors[parent] = left
            return
        del self._successors[parent]
        parked = self.unpark(parent)
        if parked is not None:
            self._release(parent, *parked)

    def park(self, key: ChunkKey, place: int, parent: ChunkKey | None) -> None:
        self._parked[key] = (place, parent)
        self._parked_at[place] += 1

    def unpark(self, key: ChunkKey) -> tuple[int, ChunkKey | None] | None:
        """Stop counting ``key`` as parked: the list it was parked from and its
        predecessor, if it was."""
        parked = self._parked.pop(key, None)
        if parked is not None:
            self._parked_at[parked[0]] -= 1
        return parked

    def take_parked(self, key: ChunkKey) -> ChunkKey | None:
        """Unpark ``key``, which the policy found in none of its lists: its predecessor;
        :class:`PolicyError` if it is not parked either (not resident)."""
        parked = self.unpark(key)
        if parked is None:
            raise missing(key)
        return parked[1]

    def place_of(self, key: ChunkKey) -> int | None:
        """The list a parked key came from; ``None`` if it is not parked."""
        parked = self._parked.get(key)
        return None if parked is None else parked[0]

    def lists(
        self,
        lists: tuple[KeyOrder, ...],
        places: tuple[int, ...],
        ghosts: tuple[KeyOrder, ...] | None = None,
        ghost_limit: int = 0,
        capacity: int = 0,
    ) -> PrefixLists:
        """The eviction walk (and ARC's insert) in C over the policy's ``lists``, numbered
        ``places``, and these links: see :class:`~tiered_kv._keytable.PrefixLists`."""
        walk = PrefixLists(
            lists, places, self._successors, self._parked, self._parked_at, ghosts, ghost_limit, capacity, PolicyError
        )
        self._walks.append(walk)
        return walk

    def first_leaf(
        self, keys: Iterable[ChunkKey], protected: Callable[[ChunkKey], bool]
    ) -> tuple[ChunkKey | None, list[ChunkKey]]:
        """The first of ``keys`` that may go on its own, and the keys passed over for
        their successors (to be parked): the one-victim eviction, without the
        bookkeeping of :class:`Victims`."""
        successors = self._successors
        passed: list[ChunkKey] = []
        for key in keys:
            if key in successors:
                if not protected(key):
                    passed.append(key)
            elif not protected(key):
                return key, passed
        return None, passed


class Victims:
    """The victims one eviction call has chosen so far, and the keys they set free."""

    __slots__ = ("_parent_of", "_successors", "_taken", "keys")

    def __init__(self, links: PrefixLinks, parent_of: Callable[[ChunkKey], ChunkKey | None]) -> None:
        self._parent_of = parent_of
        self._successors = links._successors  # read only: the counts of resident successors
        self.keys: list[ChunkKey] = []
        self._taken: dict[ChunkKey, int] = {}  # successors of a key among the victims

    def __len__(self) -> int:
        return len(self.keys)

    def is_free(self, key: ChunkKey) -> bool:
        """Whether every resident successor of ``key`` is already a victim."""
        successors = self._successors
        return key not in successors or successors[key] == self._taken.get(key, 0)

    def take(self, key: ChunkKey) -> ChunkKey | None:
        """Add victim ``key``; its predecessor if that has just lost its last successor."""
        self.keys.append(key)
        parent = self._parent_of(key)
        if parent is None:
            return None
        taken = self._taken.get(parent, 0) + 1
        self._taken[parent] = taken
        return parent if taken == self._successors[parent] else None

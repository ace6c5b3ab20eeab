"""Prefix links, so that every policy evicts the leaves of the prefix tree first.

A chunk is useful only while every chunk before it in its prompt is resident: a policy
that drops a prefix's head keeps its tail resident but unreachable. Each policy here
therefore takes a key as a victim only once no resident key names it as predecessor,
and otherwise follows its own order — descendants first, leaves before their ancestors,
as a radix-tree cache evicts.

:class:`PrefixLinks` holds the edges: each key's predecessor and how many resident keys
continue each key (a count kept for absent predecessors too, so a predecessor that
arrives after its successors finds them). :class:`Victims` and :class:`LeafWalk` choose
victims from a policy's own order without changing anything, so a policy commits them
only when all ``n`` were found.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

from tiered_kv.errors import PolicyError
from tiered_kv.keys import ChunkKey


class PrefixLinks:
    """Predecessor of each resident key that has one, and resident successors per key."""

    __slots__ = ("_parent", "_successors", "has_successors")

    def __init__(self) -> None:
        self._parent: dict[ChunkKey, ChunkKey] = {}
        self._successors: dict[ChunkKey, int] = {}
        #: Whether a resident key names ``key`` as predecessor (one ``dict`` lookup).
        self.has_successors: Callable[[ChunkKey], bool] = self._successors.__contains__

    def link(self, key: ChunkKey, parent: ChunkKey | None) -> None:
        """Record that resident ``key`` continues ``parent``; call before the key counts as
        resident, so that a bad parent changes nothing."""
        if parent is None:
            return
        if parent == key:
            raise PolicyError(f"key {key.hex()} cannot be its own predecessor")
        self._parent[key] = parent
        successors = self._successors
        successors[parent] = successors.get(parent, 0) + 1

    def unlink(self, key: ChunkKey) -> None:
        """Forget the edge of ``key``, which is no longer resident."""
        parent = self._parent.pop(key, None)
        if parent is None:
            return
        left = self._successors[parent] - 1
        if left:
            self._successors[parent] = left
        else:
            del self._successors[parent]

    def parent(self, key: ChunkKey) -> ChunkKey | None:
        return self._parent.get(key)

    def successors(self, key: ChunkKey) -> int:
        """Resident keys that name ``key`` as predecessor."""
        return self._successors.get(key, 0)

    def first_leaf(self, keys: Iterable[ChunkKey], protected: Callable[[ChunkKey], bool]) -> ChunkKey | None:
        """The first of ``keys`` that may go on its own: the single-victim case, without
        the bookkeeping of :class:`Victims`."""
        has_successors = self.has_successors
        for key in keys:
            if not protected(key) and not has_successors(key):
                return key
        return None


class Victims:
    """The victims one eviction call has chosen so far, and the keys they set free."""

    __slots__ = ("_links", "_taken", "keys", "protected")

    def __init__(self, links: PrefixLinks, protected: Callable[[ChunkKey], bool]) -> None:
        self._links = links
        self.protected = protected
        self.keys: list[ChunkKey] = []
        self._taken: dict[ChunkKey, int] = {}  # successors of a key among the victims

    def __len__(self) -> int:
        return len(self.keys)

    def is_free(self, key: ChunkKey) -> bool:
        """Whether every resident successor of ``key`` is already a victim."""
        return self._links.successors(key) == self._taken.get(key, 0)

    def take(self, key: ChunkKey) -> ChunkKey | None:
        """Add victim ``key``; its predecessor if that has just lost its last successor."""
        self.keys.append(key)
        parent = self._links.parent(key)
        if parent is None:
            return None
        taken = self._taken.get(parent, 0) + 1
        self._taken[parent] = taken
        return parent if taken == self._links.successors(parent) else None


class LeafWalk:
    """One list of a policy, oldest first, yielding the keys that may be evicted now:
    unprotected, with no resident successor left.

    A key passed over because it still has successors is remembered; when the victims
    set it free it comes next (before any key not yet reached, which is newer), oldest
    passed key first. The list must not change while the walk runs.
    """

    __slots__ = ("_keys", "_passed", "_ready", "_seen", "_victims")

    def __init__(self, keys: Iterable[ChunkKey], victims: Victims) -> None:
        self._keys = iter(keys)
        self._victims = victims
        self._passed: dict[ChunkKey, int] = {}  # key -> its place in the list
        self._ready: list[tuple[int, ChunkKey]] = []
        self._seen = 0

    def next(self) -> ChunkKey | None:
        """The next key that may go, or ``None`` when the list has none left."""
        if self._ready:
            return heapq.heappop(self._ready)[1]
        protected, is_free, passed = self._victims.protected, self._victims.is_free, self._passed
        for key in self._keys:
            self._seen += 1
            if protected(key):
                continue
            if is_free(key):
                return key
            passed[key] = self._seen
        return None

    def freed(self, key: ChunkKey) -> bool:
        """``key`` has lost its last successor to the victims; true if this walk had
        passed it over (it is then ready to go)."""
        place = self._passed.pop(key, None)
        if place is None:
            return False
        heapq.heappush(self._ready, (place, key))
        return True

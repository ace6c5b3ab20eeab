"""S3-FIFO: three static FIFO queues (Yang et al., "FIFO queues are all you need for
cache eviction", SOSP 2023).

New keys enter a small FIFO (a tenth of the capacity). While the small queue holds at
least its share, eviction works on it: a key hit at least once since it entered moves to
the main FIFO (with its count reset, as the authors' libCacheSim does), the others leave
and are remembered in a ghost queue; below its share, eviction works on main. A key
inserted while it is a ghost goes straight to main. Main is a FIFO with a 2-bit hit
counter per key: a key with hits left goes round again with one hit fewer, a key without
is evicted. One-hit wonders, which dominate
long-document scans, therefore leave after a short stay in the small queue without ever
disturbing the main queue, and a hit costs one table update with no reordering.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence

from tiered_kv._keytable import KeyInts, KeyOrder
from tiered_kv.keys import ChunkKey
from tiered_kv.policies._checks import add_new, check_capacity, check_count, check_new, duplicate, missing
from tiered_kv.policies.ghost import GhostQueue
from tiered_kv.policies.prefix import PrefixLinks, Victims
from tiered_kv.release import emptied

#: State bit: the key lives in the main queue (else in the small one).
_MAIN = 4
#: State bits: hits since the key entered its queue or last went round main, capped at 3.
_HITS = 3
#: Journal codes of :meth:`S3FIFO.evict`: the entry came from main; it was appended to
#: main; it was parked for its successors; it was put back at the front of its queue.
_FROM_MAIN = 2
_APPENDED = 1
_PARKED = 4
_REQUEUED = 8
#: Where a parked key returns: the small queue or main.
_SMALL_QUEUE, _MAIN_QUEUE = 0, 1
#: Dead queue entries tolerated beyond twice the resident keys before compaction.
_SLACK = 64


class S3FIFO:
    """Small FIFO, main FIFO and ghost queue, with all-or-nothing eviction.

    One :class:`~tiered_kv._keytable.KeyInts` maps each resident key to its state (queue
    bit and hit count); the two queues are ``deque``s of keys. :meth:`remove` only drops the state, leaving a dead
    queue entry that is skipped when it reaches the front (or compacted away), so every
    operation is O(1) amortised. ``clock`` and ``rng`` are accepted for the common
    constructor and unused: S3-FIFO is deterministic.

    After ``remove`` and a re-insert of the same key before its dead entry drains, the
    key may be visited at the older position; this only shifts its eviction order.
    """

    name = "s3fifo"
    __slots__ = (
        "_ghost",
        "_links",
        "_main",
        "_n_small",
        "_parents",
        "_small",
        "_small_target",
        "_state",
        "capacity",
    )

    def __init__(
        self, capacity: int, *, clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None
    ) -> None:
        self.capacity = check_capacity(capacity)
        self._small_target = max(1, capacity // 10)
        self._state = KeyInts()
        self._small: deque[ChunkKey] = deque()
        self._main: deque[ChunkKey] = deque()
        self._n_small = 0
        self._ghost = GhostQueue(max(1, capacity - self._small_target))
        self._links = PrefixLinks(self._release, places=2)
        self._parents = KeyOrder()  # resident key -> its predecessor, if it has one

    def __len__(self) -> int:
        return len(self._state)

    def __contains__(self, key: object) -> bool:
        return key in self._state

    def __repr__(self) -> str:
        n_main = len(self._state) - self._n_small
        return (
            f"<S3FIFO {len(self._state)}/{self.capacity} small={self._n_small} main={n_main} ghost={len(self._ghost)}>"
        )

    def in_main(self, key: ChunkKey) -> bool:
        """Whether resident ``key`` has earned its place in the main queue."""
        try:
            return bool(self._state[key] & _MAIN)
        except KeyError:
            raise missing(key) from None

    def insert(self, key: ChunkKey, parent: ChunkKey | None = None) -> None:
        state = self._state
        if key in state:
            raise duplicate(key)
        if parent is not None:
            self._links.link(key, parent)
            self._parents[key] = parent
        if self._ghost.hit(key):
            state[key] = _MAIN
            self._main.append(key)
        else:
            state[key] = 0
            self._small.append(key)
            self._n_small += 1

    def clear_in_steps(self) -> Iterator[None]:
        """Forget every key and ghost, a step at a time (a closing manager's); empty after
        the first. The queues, which hold the keys' last references, go last."""
        queues, self._small, self._main = (self._small, self._main), deque(), deque()
        self._n_small = 0
        yield from self._links.clear_in_steps(self._state, self._parents, self._ghost.table)
        for queue in queues:
            yield from emptied(queue)

    def insert_many(self, keys: Sequence[ChunkKey]) -> None:
        if self._ghost.size():  # a key may be a ghost, which insert moves to main
            check_new(keys, self.__contains__)
            for key in keys:
                self.insert(key)
            return
        add_new(self._state, keys, 0, self._links.is_parked)
        self._small.extend(keys)
        self._n_small += len(keys)

    def expect_restored(self, n: int) -> None:
        self._state.reserve(n)

    def touch(self, key: ChunkKey) -> None:
        state = self._state
        try:
            value = state[key]
        except KeyError:
            raise missing(key) from None
        if value & _HITS != _HITS:
            state[key] = value + 1

    def remove(self, key: ChunkKey) -> None:
        try:
            value = self._state.pop(key)
        except KeyError:
            raise missing(key) from None
        self._links.unpark(key)
        self._links.unlink(key, self._parents.pop(key, None))
        if not value & _MAIN:
            self._n_small -= 1
        if len(self._small) + len(self._main) > 2 * len(self._state) + _SLACK:
            self._compact()

    def _compact(self) -> None:
        """Rebuild both queues without dead entries, keeping each key's newest entry."""
        state = self._state

        def live(queue: deque[ChunkKey], where: int) -> deque[ChunkKey]:
            newest: dict[ChunkKey, None] = {}
            for key in reversed(queue):
                value = state.get(key)
                if value is not None and value & _MAIN == where and key not in newest:
                    newest[key] = None
            return deque(reversed(newest))

        self._small = live(self._small, 0)
        self._main = live(self._main, _MAIN)

    def _release(self, key: ChunkKey, place: int, parent: ChunkKey | None) -> None:
        (self._main if place == _MAIN_QUEUE else self._small).appendleft(key)

    def evict(self, n: int, protected: Callable[[ChunkKey], bool]) -> list[ChunkKey] | None:
        """``n`` keys that may go by S3-FIFO's rule, or ``None`` changing nothing.

        The queues are worked as the paper does (promotions to main, second rounds in
        main), each step journaled, keys with resident successors set aside to be parked;
        if the keys run out before ``n`` victims are found, the journal is undone in
        reverse. A key the victims set free goes back to the front of its queue, to be
        looked at next. Protected keys are set aside and put back at the front of their
        queue. Amortised O(n) plus O(p) for p keys passed over at the fronts; a failure
        has looked at every key.
        """
        check_count(n)
        if n == 0:
            return []
        state, links = self._state, self._links
        if n > len(state):
            return None
        small, main = self._small, self._main
        n_small, target = self._n_small, self._small_target
        chosen = Victims(links, self._parents.get)
        victims = chosen.keys
        leaving_small: list[ChunkKey] = []  # victims that become ghosts
        held: list[tuple[ChunkKey, int]] = []  # protected keys set aside, with their queue
        parking: dict[ChunkKey, int] = {}  # keys set aside for their successors -> queue code
        journal: list[tuple[ChunkKey, int, int]] = []  # (key, code, old state or -1)
        while len(victims) < n:
            if small and (n_small >= target or not main):
                key = small.popleft()
                value = state.get(key, _MAIN)
                if value & _MAIN:  # dead entry
                    continue
                if protected(key):
                    held.append((key, 0))
                    journal.append((key, 0, -1))
                elif value & _HITS:
                    state[key] = _MAIN
                    main.append(key)
                    n_small -= 1
                    journal.append((key, _APPENDED, value))
                elif not chosen.is_free(key):
                    parking[key] = 0
                    journal.append((key, _PARKED, -1))
                else:
                    del state[key]
                    n_small -= 1
                    freed = chosen.take(key)
                    leaving_small.append(key)
                    journal.append((key, 0, value))
                    if freed is not None:
                        self._requeue(freed, parking, journal, protected)
            elif main:
                key = main.popleft()
                value = state.get(key, 0)
                if not value & _MAIN:  # dead entry
                    continue
                if protected(key):
                    held.append((key, _FROM_MAIN))
                    journal.append((key, _FROM_MAIN, -1))
                elif value & _HITS:
                    state[key] = value - 1
                    main.append(key)
                    journal.append((key, _FROM_MAIN | _APPENDED, value))
                elif not chosen.is_free(key):
                    parking[key] = _FROM_MAIN
                    journal.append((key, _FROM_MAIN | _PARKED, -1))
                else:
                    del state[key]
                    freed = chosen.take(key)
                    journal.append((key, _FROM_MAIN, value))
                    if freed is not None:
                        self._requeue(freed, parking, journal, protected)
            else:
                self._undo(journal)
                return None
        for key, code in reversed(held):
            (main if code else small).appendleft(key)
        for key, code in parking.items():
            links.park(key, _MAIN_QUEUE if code else _SMALL_QUEUE, None)
        self._n_small = n_small
        for key in leaving_small:
            self._ghost.add(key)
        parents = self._parents
        for key in victims:
            links.unlink(key, parents.pop(key, None))
        return victims

    def _requeue(
        self,
        key: ChunkKey,
        parking: dict[ChunkKey, int],
        journal: list[tuple[ChunkKey, int, int]],
        protected: Callable[[ChunkKey], bool],
    ) -> None:
        """Victims set ``key`` free: put it back at the front of its queue, to go next,
        whether this eviction set it aside or an earlier one parked it."""
        code = parking.pop(key, None)
        if code is not None:
            (self._main if code else self._small).appendleft(key)
            journal.append((key, code | _REQUEUED, -1))
            return
        place = self._links.place_of(key)
        if place is None or protected(key):
            return
        self._links.unpark(key)
        code = _FROM_MAIN if place == _MAIN_QUEUE else 0
        (self._main if code else self._small).appendleft(key)
        journal.append((key, code | _REQUEUED, place))

    def _undo(self, journal: list[tuple[ChunkKey, int, int]]) -> None:
        """Put every popped key back where it was, with its old state."""
        small, main, state = self._small, self._main, self._state
        for key, code, old in reversed(journal):
            queue = main if code & _FROM_MAIN else small
            if code & _REQUEUED:
                queue.popleft()
                if old >= 0:  # an earlier eviction had parked it
                    self._links.park(key, old, None)
                continue
            if code & _APPENDED:
                main.pop()
            queue.appendleft(key)
            if old >= 0:
                state[key] = old

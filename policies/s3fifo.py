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
disturbing the main queue, and a hit costs one ``dict`` update with no reordering.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable

from tiered_kv.policies._checks import check_capacity, check_count, duplicate, missing
from tiered_kv.policies.ghost import GhostQueue
from tiered_kv.policies.prefix import PrefixLinks, Victims

from tiered_kv.keys import ChunkKey

#: State bit: the key lives in the main queue (else in the small one).
_MAIN = 4
#: State bits: hits since the key entered its queue or last went round main, capped at 3.
_HITS = 3
#: Journal codes of :meth:`S3FIFO.evict`: the entry came from main; it was appended to main.
_FROM_MAIN = 2
_APPENDED = 1
#: Dead queue entries tolerated beyond twice the resident keys before compaction.
_SLACK = 64


class S3FIFO:
    """Small FIFO, main FIFO and ghost queue, with all-or-nothing eviction.

    One ``dict`` maps each resident key to its state (queue bit and hit count); the two
    queues are ``deque``s of keys. :meth:`remove` only drops the state, leaving a dead
    queue entry that is skipped when it reaches the front (or compacted away), so every
    operation is O(1) amortised. ``clock`` and ``rng`` are accepted for the common
    constructor and unused: S3-FIFO is deterministic.

    After ``remove`` and a re-insert of the same key before its dead entry drains, the
    key may be visited at the older position; this only shifts its eviction order.
    """

    name = "s3fifo"
    __slots__ = ("_ghost", "_links", "_main", "_n_small", "_small", "_small_target", "_state", "capacity")

    def __init__(
        self, capacity: int, *, clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None
    ) -> None:
        self.capacity = check_capacity(capacity)
        self._small_target = max(1, capacity // 10)
        self._state: dict[ChunkKey, int] = {}
        self._small: deque[ChunkKey] = deque()
        self._main: deque[ChunkKey] = deque()
        self._n_small = 0
        self._ghost = GhostQueue(max(1, capacity - self._small_target))
        self._links = PrefixLinks()

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
        self._links.link(key, parent)
        if self._ghost.discard(key):
            state[key] = _MAIN
            self._main.append(key)
        else:
            state[key] = 0
            self._small.append(key)
            self._n_small += 1

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
        self._links.unlink(key)
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

    def evict(self, n: int, protected: Callable[[ChunkKey], bool]) -> list[ChunkKey] | None:
        """``n`` keys that may go by S3-FIFO's rule, or ``None`` changing nothing.

        The queues are worked as the paper does (promotions to main, second rounds in
        main, and the same for keys with resident successors), each step journaled; if
        the keys run out before ``n`` victims are found — or a whole round of main finds
        only keys with resident successors and small has none to give — the journal is
        undone in reverse. Protected keys are set aside and put back at the front of
        their queue. Amortised O(n) plus O(p) for p keys passed over at the fronts; a
        failure has looked at every key.
        """
        check_count(n)
        if n == 0:
            return []
        state = self._state
        if n > len(state):
            return None
        small, main = self._small, self._main
        n_small, target = self._n_small, self._small_target
        chosen = Victims(self._links, protected)
        victims = chosen.keys
        leaving_small: list[ChunkKey] = []  # victims that become ghosts
        held: list[tuple[ChunkKey, int]] = []  # protected keys set aside, with their queue
        journal: list[tuple[ChunkKey, int, int]] = []  # (key, code, old state or -1)
        spins = 0  # keys main sent round for their successors since it last changed
        while len(victims) < n:
            main_stuck = spins > len(main)
            if small and (n_small >= target or not main or main_stuck):
                key = small.popleft()
                value = state.get(key, _MAIN)
                if value & _MAIN:  # dead entry
                    continue
                if protected(key):
                    held.append((key, 0))
                    journal.append((key, 0, -1))
                elif value & _HITS or not chosen.is_free(key):
                    state[key] = _MAIN
                    main.append(key)
                    n_small -= 1
                    spins = 0  # main has a key it has not been round with
                    journal.append((key, _APPENDED, value))
                else:
                    del state[key]
                    n_small -= 1
                    chosen.take(key)
                    spins = 0
                    leaving_small.append(key)
                    journal.append((key, 0, value))
            elif main and not main_stuck:
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
                    spins = 0
                    journal.append((key, _FROM_MAIN | _APPENDED, value))
                elif not chosen.is_free(key):
                    main.append(key)
                    spins += 1
                    journal.append((key, _FROM_MAIN | _APPENDED, value))
                else:
                    del state[key]
                    chosen.take(key)
                    spins = 0
                    journal.append((key, _FROM_MAIN, value))
            else:
                self._undo(journal)
                return None
        for key, code in reversed(held):
            (main if code else small).appendleft(key)
        self._n_small = n_small
        for key in leaving_small:
            self._ghost.add(key)
        for key in victims:
            self._links.unlink(key)
        return victims

    def _undo(self, journal: list[tuple[ChunkKey, int, int]]) -> None:
        """Put every popped key back where it was, with its old state."""
        small, main, state = self._small, self._main, self._state
        for key, code, old in reversed(journal):
            if code & _APPENDED:
                main.pop()
            (main if code & _FROM_MAIN else small).appendleft(key)
            if old >= 0:
                state[key] = old

"""Admission that adapts to capacity: every chunk while the tiers are large enough for
chunks to be read again before they are evicted, else only chunks seen before.

A fixed "store on the second sighting" rule nearly doubles the hit rate of a small tier,
whose chunks would be evicted before they come back, and costs a large tier every first
reuse. What decides between the two is how far apart a chunk's sightings are compared
with what the tiers hold: a chunk that comes back within as many sightings as the tiers
have slots would still be resident had it been stored. This filter measures that
distance on chunks it turned away (only those: a stored chunk that is read again is a
hit, which a filter never sees) and admits everything while most returning chunks come
back within that horizon. While it admits everything it still turns away a fixed
sample of prompts (every 32nd run) to keep measuring.

A *run* is a prompt's consecutive missing chunks (each continuing the one asked about
before it); a decision to admit or refuse holds for the whole run, since the owner
stores nothing after the first refusal.
"""

from __future__ import annotations

from collections import OrderedDict

from tiered_kv.checks import is_int_at_least
from tiered_kv.errors import PolicyError
from tiered_kv.keys import ChunkKey
from tiered_kv.policies._checks import check_capacity

#: While admitting everything, one run in this many is refused, to keep measuring.
OBSERVED_ONE_IN = 32
#: The manager's table remembers this many times the chunks of the tiers behind it.
TABLE_PER_SLOT = 4
#: Measurements that make up the remembered evidence, at least (exponential decay).
_MIN_EVIDENCE = 64


class AdaptiveSeenK:
    """``seen_k`` whose ``k`` is 1 or the configured ``k``, chosen by measured reuse distance.

    ``capacity`` keys are remembered (an ``OrderedDict`` from least to most recently
    seen); the tiers are taken to hold a quarter of that, as the manager sizes the
    table. Distances are counted in sightings (calls to :meth:`admit`).
    """

    name = "seen_adaptive"
    __slots__ = (
        "_decay",
        "_far",
        "_near",
        "_previous",
        "_run_admitted",
        "_runs",
        "_sightings",
        "_table",
        "capacity",
        "horizon",
        "k",
        "lenient",
    )

    def __init__(self, capacity: int, *, k: int = 2) -> None:
        self.capacity = check_capacity(capacity)
        if not is_int_at_least(k, 1):
            raise PolicyError(f"k must be a positive number of sightings, got {k!r}")
        self.k = k
        self.horizon = max(1, capacity // TABLE_PER_SLOT)
        #: Whether runs are admitted on their first sighting now.
        self.lenient = True
        self._decay = 1.0 - 1.0 / max(_MIN_EVIDENCE, self.horizon)
        self._near = self._far = 0.0
        self._sightings = 0
        self._runs = 0
        self._previous: ChunkKey | None = None
        self._run_admitted = True
        # key -> (sighting at which it was turned away, or -1 if it was admitted; sightings)
        self._table: OrderedDict[ChunkKey, tuple[int, int]] = OrderedDict()

    def __len__(self) -> int:
        """Keys currently remembered (at most ``capacity``)."""
        return len(self._table)

    def __repr__(self) -> str:
        mode = "all" if self.lenient else f"k={self.k}"
        return f"<AdaptiveSeenK {mode} near={self._near:.0f} far={self._far:.0f} counted={len(self._table)}>"

    def admit(self, key: ChunkKey, parent: ChunkKey | None = None) -> bool:
        self._sightings += 1
        if parent is None or parent != self._previous:
            self._runs += 1
            self._run_admitted = self.lenient and self._runs % OBSERVED_ONE_IN != 0
        self._previous = key
        table = self._table
        entry = table.pop(key, None)
        if entry is None:
            if self._run_admitted:
                self._remember(key, (-1, 1))
                return True
            self._remember(key, (self._sightings, 1))
            return self.k == 1
        refused_at, seen = entry
        if refused_at >= 0:
            self._measure(self._sightings - refused_at)
        seen += 1
        if seen >= self.k or self._run_admitted:
            return True  # it is resident now; if it is evicted, it must be seen again
        self._remember(key, (refused_at, seen))
        return False

    def _remember(self, key: ChunkKey, entry: tuple[int, int]) -> None:
        table = self._table
        table[key] = entry
        if len(table) > self.capacity:
            table.popitem(last=False)

    def _measure(self, distance: int) -> None:
        """One turned-away chunk came back ``distance`` sightings later."""
        decay = self._decay
        self._near *= decay
        self._far *= decay
        if distance <= self.horizon:
            self._near += 1.0
        else:
            self._far += 1.0
        self.lenient = self._near >= self._far

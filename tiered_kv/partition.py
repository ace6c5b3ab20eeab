"""One tier's chunk slots shared among namespaces, each with its own policy and quota.

Every namespace (a model, a tenant) gets its own :class:`~tiered_kv.interfaces.CachePolicy`
instance, so one namespace's traffic never reorders another's keys, and optionally a
quota: a number of chunks of this tier that are its own. Quotas may add up to less than
the tier; the rest is shared. The guarantee: **a namespace at or under its quota never
loses a chunk to another namespace's traffic.** Chunks above a quota are fair game, and
victims are taken so as to even out how far each namespace is above its quota (the
namespace asking for room counts the chunks it is about to store).

Quotas are in chunks; a caller with a quota in bytes divides by the tier's chunk size.

:class:`TierPartition` is synchronous and owns no bytes. The owner (the manager) counts a
chunk from the moment it reserves the chunk's slot::

    victims = partition.make_room(ns, len(keys), protected=is_pinned_or_pending)
    if victims is None: ...            # cannot store now; nothing changed
    for owner_ns, keys_out in victims.items(): ...   # free these slots
    for key in keys: partition.insert(ns, key)
"""

from __future__ import annotations

import heapq
import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import cast

from tiered_kv.checks import is_int_at_least
from tiered_kv.errors import ConfigError, PolicyError
from tiered_kv.interfaces import (
    BatchInsertPolicy,
    BulkInsertPolicy,
    CachePolicy,
    RestoreHintPolicy,
    SteppedClearPolicy,
)
from tiered_kv.keys import ChunkKey
from tiered_kv.log import get_logger
from tiered_kv.policy_factory import make_policy

log = get_logger("partition")


class _Share:
    """One namespace's policy and quota in this tier."""

    __slots__ = ("batch", "bulk", "order", "policy", "quota")

    def __init__(self, policy: CachePolicy, quota: int, order: int) -> None:
        self.policy = policy
        #: Whether the policy inserts a batch in one call: asked once (an ``isinstance``
        #: of a runtime-checkable protocol costs tens of µs, once per batch of a restore).
        self.bulk = isinstance(policy, BulkInsertPolicy)
        self.batch = isinstance(policy, BatchInsertPolicy)
        self.quota = quota
        self.order = order  # tie-break between namespaces: the first added goes first


class Unrestored(PolicyError):
    """A :meth:`TierPartition.make_room` that failed could not give some of its victims
    back to their policies (a plug-in raised): ``victims`` (namespace -> keys) are in no
    policy any more, and their owner must forget them, as evicted. The cause is the
    policy's error."""

    def __init__(self, victims: dict[str, list[ChunkKey]]) -> None:
        super().__init__(f"{sum(map(len, victims.values()))} victims could not be given back to their policies")
        self.victims = victims


class TierPartition:
    """``capacity`` chunk slots of tier ``tier``, split among namespaces.

    Policies are built by name through the registry, each told the whole tier's
    capacity (a namespace may fill the tier while the others are idle). ``clock`` is
    passed on; each policy gets its own ``random.Random`` drawn from ``rng``.
    """

    def __init__(
        self,
        tier: str,
        capacity: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if not is_int_at_least(capacity, 1):
            raise ConfigError(f"must be a positive number of chunks, got {capacity!r}", field=f"{tier}.capacity")
        self.tier = tier
        self.capacity = capacity
        self._clock = clock
        self._rng = rng
        self._shares: dict[str, _Share] = {}
        self._used = 0

    def __repr__(self) -> str:
        parts = " ".join(f"{name}={len(s.policy)}/{s.quota}" for name, s in self._shares.items())
        return f"<TierPartition {self.tier} {self._used}/{self.capacity} {parts}>"

    @property
    def used(self) -> int:
        """Chunks held by all namespaces together."""
        return self._used

    @property
    def free(self) -> int:
        return self.capacity - self._used

    def namespaces(self) -> list[str]:
        return list(self._shares)

    def add_namespace(self, namespace: str, policy: str, *, quota: int = 0) -> None:
        """Give ``namespace`` a new ``policy`` instance and ``quota`` chunks of its own.

        For a :class:`~tiered_kv.config.NamespacePolicyConfig` ``cfg``:
        ``add_namespace(ns, cfg.policy, quota=cfg.quota_chunks.get(tier, 0))``.
        """
        if namespace in self._shares:
            raise PolicyError(f"namespace {namespace!r} is already in tier {self.tier}")
        if not is_int_at_least(quota, 0):
            raise ConfigError(
                f"must be a non-negative number of chunks, got {quota!r}", field=f"quota_chunks.{self.tier}"
            )
        reserved = sum(share.quota for share in self._shares.values())
        if reserved + quota > self.capacity:
            raise ConfigError(
                f"{namespace!r} asks for {quota} chunks but only {self.capacity - reserved} of the tier's "
                f"{self.capacity} are not already reserved",
                field=f"quota_chunks.{self.tier}",
            )
        child_rng = random.Random(self._rng.getrandbits(64)) if self._rng is not None else None
        built = make_policy(policy, self.capacity, clock=self._clock, rng=child_rng)
        self._shares[namespace] = _Share(built, quota, len(self._shares))

    def remove_namespace(self, namespace: str) -> None:
        """Forget a namespace that holds no chunk here, freeing its quota for others."""
        if self.usage(namespace):
            raise PolicyError(f"namespace {namespace!r} still holds {self.usage(namespace)} chunks in {self.tier}")
        del self._shares[namespace]

    def _share(self, namespace: str) -> _Share:
        try:
            return self._shares[namespace]
        except KeyError:
            raise PolicyError(f"namespace {namespace!r} was not added to tier {self.tier}") from None

    def policy(self, namespace: str) -> CachePolicy:
        return self._share(namespace).policy

    def usage(self, namespace: str) -> int:
        """Chunks ``namespace`` holds in this tier."""
        return len(self._share(namespace).policy)

    def quota(self, namespace: str) -> int:
        return self._share(namespace).quota

    def contains(self, namespace: str, key: ChunkKey) -> bool:
        return key in self._share(namespace).policy

    def insert(self, namespace: str, key: ChunkKey, parent: ChunkKey | None = None) -> None:
        """Count ``key`` (continuing ``parent``, see :class:`~tiered_kv.interfaces.CachePolicy`)
        as held by ``namespace``; the tier must have a free slot."""
        self.inserter(namespace, 1)(key, parent)
        self.count_inserted(1)

    def inserter(self, namespace: str, n: int) -> Callable[[ChunkKey, ChunkKey | None], None]:
        """``namespace``'s policy's ``insert``, for a caller that inserts ``n`` keys one by
        one (no Python step of the partition's per key) and then counts those inserted
        with :meth:`count_inserted`; the tier must have room for all ``n``."""
        share = self._share(namespace)
        if self._used + n > self.capacity:
            raise PolicyError(f"tier {self.tier} is full ({self.capacity} chunks); make room first")
        return cast("BatchInsertPolicy", share.policy).inserter() if share.batch else share.policy.insert

    def count_inserted(self, n: int) -> None:
        """Count ``n`` keys inserted through :meth:`inserter`."""
        self._used += n

    def expect_restored(self, namespace: str, n: int) -> None:
        """Tell ``namespace``'s policy, if it listens (see
        :class:`~tiered_kv.interfaces.RestoreHintPolicy`), that :meth:`insert_many`
        batches of about ``n`` keys (at most the tier's) are coming. A hint that raises
        is logged: the restart goes on without it."""
        policy = self._share(namespace).policy
        if n <= 0 or not isinstance(policy, RestoreHintPolicy):
            return
        try:
            policy.expect_restored(min(n, self.capacity))
        except Exception as exc:  # a plug-in's hint: never worth a restart
            log.warning("policy.restore_hint_failed", tier=self.tier, policy=policy.name, error=repr(exc))

    def insert_many(self, namespace: str, keys: Sequence[ChunkKey]) -> None:
        """:meth:`insert` of each of ``keys``, in order (a warm restart's batches)."""
        share = self._share(namespace)
        if self._used + len(keys) > self.capacity:
            raise PolicyError(f"tier {self.tier} is full ({self.capacity} chunks); make room first")
        if share.bulk:
            cast("BulkInsertPolicy", share.policy).insert_many(keys)
        else:
            for key in keys:
                share.policy.insert(key)
        self._used += len(keys)

    def clear_in_steps(self) -> Iterator[None]:
        """Let go of every share's keys, a step at a time where the policy can (see
        :class:`~tiered_kv.interfaces.SteppedClearPolicy`), at once where it cannot: a
        closing manager's. The partition is of no use after."""
        shares, self._shares = list(self._shares.values()), {}
        self._used = 0
        for share in shares:
            if isinstance(share.policy, SteppedClearPolicy):
                yield from share.policy.clear_in_steps()

    def touch(self, namespace: str, key: ChunkKey) -> None:
        """Record a hit on ``key``."""
        self._share(namespace).policy.touch(key)

    def remove(self, namespace: str, key: ChunkKey) -> None:
        """Forget ``key``, which the owner dropped itself (not an eviction)."""
        self._share(namespace).policy.remove(key)
        self._used -= 1

    def make_room(
        self,
        namespace: str,
        n: int,
        protected: Callable[[ChunkKey], bool],
        parent_of: Callable[[ChunkKey], ChunkKey | None] = lambda key: None,
    ) -> dict[str, list[ChunkKey]] | None:
        """Free enough slots for ``namespace`` to store ``n`` more chunks.

        Returns the victims by namespace (empty when the tier already has room), already
        forgotten by their policies; the owner frees their slots. Returns ``None`` when
        the room cannot be made without a protected key or without pushing another
        namespace below its quota; the resident chunks are then unchanged.

        Victims come from ``namespace`` itself and from namespaces above their quota,
        one at a time from whichever is furthest above its quota. If a policy then has
        fewer unprotected keys than planned, the shortfall is asked of the others.
        Limitation: the protocol has no dry run, so if they all fall short after some
        victims were taken, those are re-inserted (with their predecessors from
        ``parent_of``); the resident set is as before, but their recency (and ghost state)
        in their policies is not.
        """
        requester = self._share(namespace)
        if not is_int_at_least(n, 0):
            raise PolicyError(f"cannot make room for {n!r} chunks; n must be a non-negative integer")
        deficit = n - self.free
        if deficit <= 0:
            return {}
        if len(self._shares) == 1:  # the requester alone: no plan to make, nothing to restore
            victims = requester.policy.evict(deficit, protected)
            if victims is None:
                return None
            self._used -= deficit
            return {namespace: victims}
        # The most each namespace may lose: its chunks above its quota (all of its own, for the requester).
        limit = {
            name: len(share.policy) if share is requester else max(0, len(share.policy) - share.quota)
            for name, share in self._shares.items()
        }
        taken: dict[str, list[ChunkKey]] = {name: [] for name in self._shares}
        try:
            while deficit > 0:
                plan = self._plan(deficit, requester, n, limit, taken)
                if plan is None:
                    self._restore(taken, parent_of)
                    return None
                for name, count in plan.items():
                    victims = self._shares[name].policy.evict(count, protected)
                    if victims is None:
                        limit[name] = len(taken[name]) + count - 1  # it has fewer than count to give
                        continue
                    taken[name] += victims
                    deficit -= count
                    self._used -= count
        except Unrestored:
            raise
        except BaseException as exc:  # a policy raised (a plug-in): put back what was taken
            self._restore(taken, parent_of, exc)
            raise
        return {name: keys for name, keys in taken.items() if keys}

    def _plan(
        self,
        deficit: int,
        requester: _Share,
        n: int,
        limit: dict[str, int],
        taken: dict[str, list[ChunkKey]],
    ) -> dict[str, int] | None:
        """How many victims to ask of each namespace: one at a time from whichever would
        be furthest above its quota (the requester counting its ``n`` new chunks)."""
        heap: list[tuple[int, int, int, str]] = []
        for name, share in self._shares.items():
            if limit[name] > len(taken[name]):
                above = len(share.policy) - share.quota + (n if share is requester else 0)
                heapq.heappush(heap, (-above, share is not requester, share.order, name))
        plan: dict[str, int] = {}
        for _ in range(deficit):
            if not heap:
                return None
            minus_above, later, order, name = heapq.heappop(heap)
            plan[name] = plan.get(name, 0) + 1
            if limit[name] > len(taken[name]) + plan[name]:
                heapq.heappush(heap, (minus_above + 1, later, order, name))
        return plan

    def _restore(
        self,
        taken: dict[str, list[ChunkKey]],
        parent_of: Callable[[ChunkKey], ChunkKey | None],
        failure: BaseException | None = None,
    ) -> None:
        """Re-insert victims taken by a make_room that then failed (``failure``: raised by
        a policy), in the order taken; :class:`Unrestored` names those a policy would not
        take back, which no policy holds any more."""
        lost: dict[str, list[ChunkKey]] = {}
        for name, keys in taken.items():
            policy = self._shares[name].policy
            for key in keys:
                try:
                    policy.insert(key, parent_of(key))
                except Exception as exc:  # a plug-in's: the key is in no policy now
                    lost.setdefault(name, []).append(key)
                    failure = failure or exc
                else:
                    self._used += 1
        if lost:
            raise Unrestored(lost) from failure

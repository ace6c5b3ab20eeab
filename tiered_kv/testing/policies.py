"""The contract every :class:`~tiered_kv.interfaces.CachePolicy` passes.

Two parts, both driven through the protocol only:

* :class:`CachePolicyContract`, a pytest mixin of behaviour tests: misuse raises
  :class:`~tiered_kv.errors.PolicyError`, eviction returns exactly ``n`` unprotected
  resident keys, an eviction that cannot be satisfied changes nothing — not even the
  order of later victims — and the prefix property: a key is never evicted while a
  resident key names it as predecessor.
* :func:`policy_state_machine`, a hypothesis state machine that runs random sequences of
  inserts with random predecessors (making room first when full, as an owner does),
  touches, removes and evictions with random protected sets against a reference model,
  the resident keys and their predecessors, checking after every step: size never above
  capacity, protected keys never evicted, every victim's resident successors evicted
  with it, eviction refused exactly when no such set of ``n`` keys exists and then
  changing nothing, no key lost or duplicated; and that a bulk ``insert_many`` (where a
  policy has one) leaves it choosing the victims that one insert per key would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, cast

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tiered_kv.errors import PolicyError
from tiered_kv.interfaces import BulkInsertPolicy, CachePolicy, RestoreHintPolicy, SteppedClearPolicy
from tiered_kv.keys import KEY_BYTES, ChunkKey

PolicyMaker = Callable[[int], CachePolicy]


def chunk_key(i: int) -> ChunkKey:
    """A distinct, readable 16-byte key for test number ``i``."""
    return i.to_bytes(KEY_BYTES, "big")


def never(key: ChunkKey) -> bool:
    """The empty protected set."""
    return False


def insert_chain(policy: CachePolicy, keys: list[ChunkKey], parent: ChunkKey | None = None) -> None:
    """Insert ``keys`` as one prompt's chunks, each continuing the one before, head first."""
    for key in keys:
        policy.insert(key, parent)
        parent = key


def drain(policy: CachePolicy) -> list[ChunkKey]:
    """Evict every key one at a time: the policy's whole eviction order."""
    order: list[ChunkKey] = []
    while len(policy):
        victims = policy.evict(1, never)
        assert victims is not None and len(victims) == 1, f"{policy!r} refused to evict an unprotected key"
        order += victims
    return order


class CachePolicyContract:
    """Behaviour every cache policy shows. Set ``make`` to ``(capacity) -> CachePolicy``."""

    make: ClassVar[PolicyMaker]
    capacity: ClassVar[int] = 16

    def new(self, capacity: int | None = None) -> CachePolicy:
        maker: PolicyMaker = type(self).make
        return maker(self.capacity if capacity is None else capacity)

    def filled(self, count: int | None = None) -> CachePolicy:
        policy = self.new()
        for i in range(self.capacity if count is None else count):
            policy.insert(chunk_key(i))
        return policy

    def history(self, policy: CachePolicy) -> None:
        """A mixed past: fill, hits, evictions, a key coming back (a ghost hit), a removal."""
        keys = [chunk_key(i) for i in range(self.capacity)]
        for key in keys:
            policy.insert(key)
        for key in keys[::3]:
            policy.touch(key)
        gone = policy.evict(4, never)
        assert gone is not None
        policy.insert(gone[0])
        policy.insert(chunk_key(1000))
        policy.remove(keys[1] if keys[1] in policy else gone[0])
        policy.touch(chunk_key(1000))

    def test_speaks_the_protocol(self) -> None:
        policy = self.new()
        assert isinstance(policy, CachePolicy)
        assert isinstance(policy.name, str) and policy.name

    def test_starts_empty(self) -> None:
        policy = self.new()
        assert len(policy) == 0
        assert chunk_key(0) not in policy
        assert policy.evict(0, never) == []
        assert policy.evict(1, never) is None

    def test_inserted_keys_are_resident_and_counted(self) -> None:
        policy = self.filled(5)
        assert len(policy) == 5
        assert all(chunk_key(i) in policy for i in range(5))
        assert chunk_key(5) not in policy

    def test_inserting_a_resident_key_is_an_error_and_changes_nothing(self) -> None:
        policy = self.filled(3)
        with pytest.raises(PolicyError):
            policy.insert(chunk_key(1))
        assert len(policy) == 3

    def test_a_bulk_insert_of_a_resident_parked_or_repeated_key_changes_nothing(self) -> None:
        policy = self.new()
        if not isinstance(policy, BulkInsertPolicy):
            pytest.skip(f"{policy.name} has no insert_many")
        head, tail, other, fresh = map(chunk_key, range(4))
        insert_chain(policy, [head, tail])
        policy.insert(other)
        # The head is passed over (it has a successor), the tail is protected.
        assert policy.evict(1, {tail}.__contains__) == [other]
        for keys in ([fresh, head], [fresh, tail], [fresh, fresh]):
            with pytest.raises(PolicyError):
                policy.insert_many(keys)
            assert fresh not in policy and len(policy) == 2
        policy.insert_many([fresh, other])
        assert len(policy) == 4 and {fresh, other} <= set(drain(policy))

    def test_a_policy_cleared_in_steps_is_empty_from_the_first_and_takes_its_keys_again(self) -> None:
        policy = self.new()
        if not isinstance(policy, SteppedClearPolicy):
            pytest.skip(f"{policy.name} cannot be cleared in steps")
        self.history(policy)
        insert_chain(policy, [chunk_key(2000), chunk_key(2001)])
        steps = policy.clear_in_steps()
        next(steps, None)
        assert len(policy) == 0 and policy.evict(1, never) is None
        assert not any(chunk_key(i) in policy for i in (*range(self.capacity), 1000, 2000, 2001))
        for _ in steps:
            pass
        new = self.new()
        for each in (policy, new):
            self.history(each)
        assert drain(policy) == drain(new), "a cleared policy decides as a new one (no key, link or ghost left)"

    def test_touching_or_removing_an_absent_key_is_an_error(self) -> None:
        policy = self.filled(3)
        with pytest.raises(PolicyError):
            policy.touch(chunk_key(7))
        with pytest.raises(PolicyError):
            policy.remove(chunk_key(7))
        assert len(policy) == 3

    def test_capacity_must_be_positive(self) -> None:
        for bad in (0, -1):
            with pytest.raises(PolicyError):
                self.new(bad)

    def test_a_touched_key_stays_resident(self) -> None:
        policy = self.filled(4)
        policy.touch(chunk_key(2))
        policy.touch(chunk_key(2))
        assert chunk_key(2) in policy and len(policy) == 4

    def test_a_removed_key_is_gone_and_may_return(self) -> None:
        policy = self.filled(4)
        policy.remove(chunk_key(1))
        assert chunk_key(1) not in policy and len(policy) == 3
        with pytest.raises(PolicyError):
            policy.remove(chunk_key(1))
        policy.insert(chunk_key(1))
        assert chunk_key(1) in policy and len(policy) == 4

    def test_a_negative_count_is_an_error(self) -> None:
        policy = self.filled(4)
        with pytest.raises(PolicyError):
            policy.evict(-1, never)
        assert len(policy) == 4

    def test_evict_returns_exactly_n_distinct_resident_keys_and_forgets_them(self) -> None:
        policy = self.new()
        self.history(policy)
        before = {chunk_key(i) for i in [*range(self.capacity), 1000] if chunk_key(i) in policy}
        victims = policy.evict(3, never)
        assert victims is not None and len(victims) == 3 and len(set(victims)) == 3
        assert set(victims) <= before
        assert all(key not in policy for key in victims)
        assert len(policy) == len(before) - 3

    def test_evict_never_returns_a_protected_key(self) -> None:
        policy = self.filled()
        keep = {chunk_key(i) for i in range(0, self.capacity, 2)}
        victims = policy.evict(self.capacity // 2, keep.__contains__)
        assert victims is not None and set(victims) == {chunk_key(i) for i in range(1, self.capacity, 2)}
        assert all(key in policy for key in keep)
        assert policy.evict(1, keep.__contains__) is None

    def test_an_eviction_that_cannot_be_satisfied_changes_nothing(self) -> None:
        failed, untouched = self.new(), self.new()
        self.history(failed)
        self.history(untouched)
        resident = [key for key in map(chunk_key, [*range(self.capacity), 1000]) if key in failed]
        free = set(resident[-2:])
        assert failed.evict(3, lambda key: key not in free) is None
        assert failed.evict(len(resident) + 1, never) is None
        assert len(failed) == len(untouched) == len(resident)
        # Same later history, same outcome: the failed calls left no trace in the order or the ghosts.
        for policy in (failed, untouched):
            for key in resident[:2]:
                policy.touch(key)
        assert drain(failed) == drain(untouched)
        for policy in (failed, untouched):
            for key in resident:
                policy.insert(key)
        assert drain(failed) == drain(untouched)

    def test_evicting_everything_empties_it_and_it_fills_again(self) -> None:
        policy = self.filled()
        victims = policy.evict(self.capacity, never)
        assert victims is not None and set(victims) == {chunk_key(i) for i in range(self.capacity)}
        assert len(policy) == 0
        for i in range(self.capacity):
            policy.insert(chunk_key(i))
        assert len(policy) == self.capacity

    def test_the_same_operations_choose_the_same_victims(self) -> None:
        one, two = self.new(), self.new()
        self.history(one)
        self.history(two)
        assert drain(one) == drain(two)

    def test_churn_at_capacity_keeps_every_count_right(self) -> None:
        policy = self.new()
        resident: set[ChunkKey] = set()
        for step in range(20 * self.capacity):
            key = chunk_key(step % (3 * self.capacity))  # keys come back: ghosts and hits
            if key in resident:
                policy.touch(key)
                continue
            if len(resident) == self.capacity:
                victims = policy.evict(1, never)
                assert victims is not None and victims[0] in resident
                resident.discard(victims[0])
            policy.insert(key)
            resident.add(key)
            assert len(policy) == len(resident)
        assert set(drain(policy)) == resident

    # -- the prefix property ---------------------------------------------------------

    def test_a_prompts_chunks_go_tail_first(self) -> None:
        policy = self.new()
        chain = [chunk_key(i) for i in range(5)]
        insert_chain(policy, chain)
        for key in chain:
            policy.touch(key)  # as an owner touches a hit prompt: head to tail
        assert drain(policy) == chain[::-1]

    def test_a_shared_prefix_outlives_every_prompt_that_continues_it(self) -> None:
        policy = self.new()
        head = [chunk_key(i) for i in range(3)]
        insert_chain(policy, head)
        branches = [[chunk_key(10 * b + i) for i in range(3)] for b in range(1, 4)]
        for branch in branches:
            insert_chain(policy, branch, head[-1])
        order = drain(policy)
        assert set(order[:9]) == {key for branch in branches for key in branch}
        assert order[9:] == head[::-1]
        for branch in branches:
            assert [order.index(key) for key in branch] == sorted((order.index(key) for key in branch), reverse=True)

    def test_a_whole_chain_goes_in_one_eviction(self) -> None:
        policy = self.new()
        chain = [chunk_key(i) for i in range(6)]
        insert_chain(policy, chain)
        victims = policy.evict(6, never)
        assert victims is not None and sorted(victims) == sorted(chain) and len(policy) == 0

    def test_a_protected_key_keeps_every_key_before_it(self) -> None:
        policy = self.new()
        chain = [chunk_key(i) for i in range(4)]
        insert_chain(policy, chain)
        tail = {chain[-1]}
        assert policy.evict(1, tail.__contains__) is None
        assert len(policy) == 4
        policy.insert(chunk_key(99))
        assert policy.evict(1, tail.__contains__) == [chunk_key(99)]
        assert all(key in policy for key in chain)

    def test_a_predecessor_that_arrives_after_its_successor_stays_behind_it(self) -> None:
        policy = self.new()
        policy.insert(chunk_key(2), chunk_key(1))  # its predecessor lives elsewhere, for now
        policy.insert(chunk_key(1), chunk_key(0))
        assert drain(policy) == [chunk_key(2), chunk_key(1)]

    def test_removing_a_predecessor_leaves_its_successors_evictable(self) -> None:
        policy = self.new()
        chain = [chunk_key(i) for i in range(4)]
        insert_chain(policy, chain)
        policy.remove(chain[1])  # the owner dropped it: chunk 2 now starts a prefix here
        order = drain(policy)
        assert sorted(order) == sorted([chain[0], chain[2], chain[3]])
        assert order.index(chain[3]) < order.index(chain[2])

    def test_a_key_cannot_be_its_own_predecessor(self) -> None:
        policy = self.new()
        with pytest.raises(PolicyError):
            policy.insert(chunk_key(1), chunk_key(1))
        assert len(policy) == 0 and chunk_key(1) not in policy
        policy.insert(chunk_key(1))
        assert len(policy) == 1

    def test_a_failed_eviction_among_chains_changes_nothing(self) -> None:
        failed, untouched = self.new(), self.new()
        for policy in (failed, untouched):
            insert_chain(policy, [chunk_key(i) for i in range(4)])
            insert_chain(policy, [chunk_key(10 + i) for i in range(4)], chunk_key(1))
        tips = {chunk_key(3), chunk_key(13)}
        # Chunks 2 and 12 may go, then 0, 1, 11, 10 are all ancestors of a protected tip.
        assert failed.evict(3, tips.__contains__) is None
        assert len(failed) == 8
        assert drain(failed) == drain(untouched)


def _raises_policy_error(call: Callable[..., Any], *args: Any) -> None:
    try:
        call(*args)
    except PolicyError:
        return
    raise AssertionError(f"{call.__qualname__}{args!r} did not raise PolicyError")


def policy_state_machine(
    make: PolicyMaker,
    *,
    capacity: int = 8,
    key_space: int = 24,
    max_examples: int = 60,
    steps: int = 50,
) -> type[RuleBasedStateMachine]:
    """A state machine checking ``make(capacity)`` against a model of its resident keys.

    A twin policy gets the same calls, except that it takes the keys of an
    ``insert_many`` (where the policy has one) one :meth:`insert` at a time: the two
    must choose the same victims throughout. Use its ``TestCase`` as a test class.

    Keys come from a pool of ``key_space`` so that evicted keys return (exercising
    ghosts and hit counters). Each insert names a predecessor drawn from the keys before
    it in the pool (or none), so predecessors form a forest, resident or not, as chained
    chunk keys do.
    """
    pool = [chunk_key(i) for i in range(key_space)]
    indices = st.integers(0, key_space - 1)

    class PolicyMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.policy = make(capacity)
            self.twin = make(capacity)
            #: Resident key -> the predecessor it was inserted with.
            self.model: dict[ChunkKey, ChunkKey | None] = {}

        def successors(self, key: ChunkKey) -> list[ChunkKey]:
            return [other for other, parent in self.model.items() if parent == key]

        def evictable(self, protected: frozenset[ChunkKey]) -> set[ChunkKey]:
            """Resident keys that may go: unprotected, with no protected key among their
            resident descendants (the largest set a policy can choose from)."""
            keep: set[ChunkKey] = set()
            for key in self.model:
                if key in protected:
                    node: ChunkKey | None = key
                    while node is not None and node in self.model and node not in keep:
                        keep.add(node)
                        node = self.model[node]
            return set(self.model) - keep

        def check_victims(self, victims: list[ChunkKey], n: int, candidates: set[ChunkKey]) -> None:
            assert len(victims) == n and len(set(victims)) == n, f"victims {victims} are not {n} distinct keys"
            assert set(victims) <= candidates, f"victims {victims} include protected, absent or pinned-ancestor keys"
            gone = set(victims)
            for key in victims:
                kept = [s for s in self.successors(key) if s not in gone]
                assert not kept, f"evicted {key.hex()} but kept its successors {kept}"

        def make_room(self, n: int) -> None:
            """Evict what storing ``n`` more keys needs, as an owner does before it stores."""
            over = len(self.model) + n - capacity
            if over <= 0:
                return
            victims = self.policy.evict(over, never)
            assert victims is not None, f"{self.policy!r} refused to evict {over} of {len(self.model)} keys"
            self.check_victims(victims, over, set(self.model))
            assert self.twin.evict(over, never) == victims, "the twin chose other victims"
            for key in victims:
                del self.model[key]

        @rule(i=indices, parent=st.one_of(st.none(), st.integers(0, key_space - 1)))
        def insert(self, i: int, parent: int | None) -> None:
            key = pool[i]
            before = pool[parent] if parent is not None and parent < i else None
            if key in self.model:
                _raises_policy_error(self.policy.insert, key, before)
                return
            self.make_room(1)
            self.policy.insert(key, before)
            self.twin.insert(key, before)
            self.model[key] = before

        @precondition(lambda self: isinstance(self.policy, BulkInsertPolicy))
        @rule(numbers=st.lists(indices, max_size=capacity))
        def insert_many(self, numbers: list[int]) -> None:
            keys = [pool[i] for i in numbers]
            bulk = cast(BulkInsertPolicy, self.policy)
            if len(set(keys)) < len(keys) or any(key in self.model for key in keys):
                _raises_policy_error(bulk.insert_many, keys)  # changing nothing: the twin got nothing
                return
            self.make_room(len(keys))
            bulk.insert_many(keys)
            for key in keys:
                self.twin.insert(key)
                self.model[key] = None

        @precondition(lambda self: isinstance(self.policy, RestoreHintPolicy))
        @rule(n=st.integers(1, 4 * capacity))
        def expect_restored(self, n: int) -> None:
            """A hint, empty or not: the policy holds and decides as its twin does."""
            cast(RestoreHintPolicy, self.policy).expect_restored(n)

        @rule(i=indices)
        def touch(self, i: int) -> None:
            key = pool[i]
            if key in self.model:
                self.policy.touch(key)
                self.twin.touch(key)
            else:
                _raises_policy_error(self.policy.touch, key)

        @rule(i=indices)
        def remove(self, i: int) -> None:
            key = pool[i]
            if key in self.model:
                self.policy.remove(key)
                self.twin.remove(key)
                del self.model[key]
            else:
                _raises_policy_error(self.policy.remove, key)

        @rule(n=st.integers(0, capacity + 2), protected=st.frozensets(st.sampled_from(pool)))
        def evict(self, n: int, protected: frozenset[ChunkKey]) -> None:
            candidates = self.evictable(protected)
            victims = self.policy.evict(n, protected.__contains__)
            assert self.twin.evict(n, protected.__contains__) == victims, "the twin chose other victims"
            if len(candidates) < n:
                assert victims is None, f"evicted {victims} though only {len(candidates)} keys could go"
                return  # all-or-nothing: the invariant checks that nothing changed
            assert victims is not None, f"refused {n} victims among {len(candidates)} keys that could go"
            self.check_victims(victims, n, candidates)
            for key in victims:
                del self.model[key]

        @rule(n=st.integers(-3, -1))
        def evict_negative(self, n: int) -> None:
            _raises_policy_error(self.policy.evict, n, never)

        @invariant()
        def holds_exactly_the_model(self) -> None:
            assert len(self.policy) == len(self.twin) == len(self.model) <= capacity
            assert {key for key in pool if key in self.policy} == set(self.model)

    PolicyMachine.TestCase.settings = settings(max_examples=max_examples, stateful_step_count=steps, deadline=None)
    return PolicyMachine

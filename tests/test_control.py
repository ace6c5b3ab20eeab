"""The control plane on its own: plans, completions, leases, tenants — no drivers, no loop."""

from __future__ import annotations

import random

import msgspec
import pytest
from conftest import make_namespace
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_kv import NamespacePolicyConfig, WritePolicy, chunk_keys
from tiered_kv.control import ChunkState, ControlPlane, Pool, PromotionOutcome
from tiered_kv.telemetry import Telemetry

NS = make_namespace()
K = NS.geometry.blocks_per_chunk


def plane(
    cpu: int = 4, nvme: int = 8, write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
) -> tuple[ControlPlane, Pool]:
    control = ControlPlane(Telemetry(1000), max_tenants=8)
    (pool,) = control.add_pools(NS, NamespacePolicyConfig(write_policy=write_policy), cpu, nvme)
    return control, pool


def keys(n: int, start: int = 0) -> list[bytes]:
    return chunk_keys(NS, list(range(start, start + n * NS.geometry.chunk_size)))


def blocks(n: int) -> list[int]:
    return list(range(n * K))


def stored(control: ControlPlane, pool: Pool, chunk_keys_: list[bytes], *, to_nvme: bool = False) -> None:
    plan = control.plan_store(NS, [chunk_keys_], [blocks(len(chunk_keys_))])
    for group in plan.groups:
        wanted = control.complete_store(group, ok=True)
        if to_nvme and wanted:
            write = control.plan_nvme_copy(pool, wanted, NS.fingerprint_hex)
            assert write is not None
            control.complete_nvme_write(write, ok=True)


def test_a_chunk_goes_pending_then_ready_then_nvme_only() -> None:
    control, pool = plane(cpu=2)
    first = keys(2)
    plan = control.plan_store(NS, [first], [blocks(2)])
    assert [pool.state(k, NS.fingerprint_hex) for k in first] == [ChunkState.CPU_PENDING] * 2
    (group,) = plan.groups
    write_through = control.complete_store(group, ok=True)
    assert write_through == first
    write = control.plan_nvme_copy(pool, write_through, NS.fingerprint_hex)
    assert write is not None
    control.complete_nvme_write(write, ok=True)
    assert pool.state(first[0], NS.fingerprint_hex) is ChunkState.CPU_READY
    stored(control, pool, keys(2, start=10_000))  # pushes both out of cpu
    assert [pool.state(k, NS.fingerprint_hex) for k in first] == [ChunkState.NVME_READY] * 2
    control.verify_invariants()


def test_a_copy_to_nvme_takes_only_the_chunks_ready_in_cpu_for_its_namespace_that_nvme_lacks() -> None:
    """The write-through's usual case (all READY, none on nvme) is found in C; any other
    mix is filtered key by key, as before."""
    control, pool = plane(cpu=8, nvme=8)
    ready, on_nvme = keys(2), keys(2, start=10_000)
    stored(control, pool, on_nvme, to_nvme=True)
    stored(control, pool, ready)
    pending = keys(2, start=20_000)
    control.plan_store(NS, [pending], [blocks(2)])
    other = msgspec.structs.replace(NS, lora_id="b").fingerprint_hex
    assert control.plan_nvme_copy(pool, ready, other) is None  # READY, but for another namespace
    assert pool.cpu.pinned == 0
    write = control.plan_nvme_copy(pool, [*on_nvme, pending[0], *ready, pending[1]], NS.fingerprint_hex)
    assert write is not None and [key for key, _, _ in write.chunks] == ready
    assert write.pinned == ready and [pool.cpu.pins(key) for key in ready] == [1, 1]
    control.complete_nvme_write(write, ok=True)
    assert [pool.state(k, NS.fingerprint_hex) for k in ready] == [ChunkState.CPU_READY] * 2
    assert pool.cpu.pinned == 0 and all(key in pool.nvme for key in ready)  # type: ignore[operator]
    control.verify_invariants()


def test_another_tenant_sees_nothing_of_a_chunk() -> None:
    control, pool = plane()
    stored(control, pool, keys(1))
    other = msgspec.structs.replace(NS, lora_id="b")
    assert pool.state(keys(1)[0], other.fingerprint_hex) is ChunkState.ABSENT
    assert control.lookup(other, [keys(1)]) == 0
    assert control.lookup(NS, [keys(1)]) == 1


def test_a_leased_chunk_is_not_evicted_until_the_step_ends() -> None:
    control, pool = plane(cpu=2, nvme=0)
    held = keys(2)
    stored(control, pool, held)
    for key in held:
        control.lease(pool, key)
    assert control.plan_store(NS, [keys(1, start=5000)], [blocks(1)]).rejected
    control.end_step()
    plan = control.plan_store(NS, [keys(1, start=5000)], [blocks(1)])
    assert not plan.rejected and plan.submitted == 1
    control.verify_invariants()


def test_a_partial_store_keeps_the_prefix_that_fits_and_a_whole_one_nothing() -> None:
    control, pool = plane(cpu=4, nvme=0)
    pinned = keys(2)
    stored(control, pool, pinned)
    for key in pinned:
        control.pin(pool, key)
    offer = keys(4, start=7000)
    whole = control.plan_store(NS, [offer], [blocks(4)])
    assert whole.rejected and pool.cpu.used == 2  # nothing changed
    part = control.plan_store(NS, [offer], [blocks(4)], partial=True)
    assert part.submitted == 2 and part.skipped == 2
    assert [key for key, _ in part.groups[0].chunks] == offer[:2]
    control.verify_invariants()


def test_a_corrupt_promotion_drops_the_nvme_copy_and_a_failed_one_keeps_it() -> None:
    control, pool = plane(cpu=1, nvme=4)
    first = keys(2)
    stored(control, pool, first[:1], to_nvme=True)
    stored(control, pool, first[1:], to_nvme=True)  # first[0] is on nvme only now
    ns = NS.fingerprint_hex
    promotion = control.plan_promotion(pool, first[0], ns)
    assert not isinstance(promotion, bool)
    assert pool.state(first[0], ns) is ChunkState.CPU_PENDING
    assert control.complete_promotion(promotion, PromotionOutcome.FAILED) == []
    assert pool.state(first[0], ns) is ChunkState.NVME_READY
    promotion = control.plan_promotion(pool, first[0], ns)
    assert not isinstance(promotion, bool)
    forget = control.complete_promotion(promotion, PromotionOutcome.CORRUPT)
    assert forget == [promotion.nvme_slot]
    assert pool.state(first[0], ns) is ChunkState.ABSENT
    control.verify_invariants()


@pytest.mark.parametrize("seed", range(10))
def test_random_plans_and_outcomes_keep_the_indexes_consistent(seed: int) -> None:
    """Plans completed in any order, as failures or successes, with leases, pins and
    promotions in between: the indexes never contradict themselves and end with no pin."""
    rng = random.Random(seed)
    control, pool = plane(cpu=6, nvme=12, write_policy=rng.choice(list(WritePolicy)))
    ns = NS.fingerprint_hex
    universe = keys(30)
    open_groups: list = []
    open_writes: list = []
    open_promotions: list = []
    pins: list[bytes] = []
    for _ in range(400):
        action = rng.randrange(7)
        if action == 0:
            start = rng.randrange(len(universe) - 3)
            plan = control.plan_store(NS, [universe[start : start + 3]], [blocks(3)], partial=rng.random() < 0.5)
            open_groups += plan.groups
        elif action == 1 and open_groups:
            group = open_groups.pop(rng.randrange(len(open_groups)))
            spill = control.plan_spill(pool, group.evicted)
            if spill is not None:
                open_writes.append(spill)
            wanted = control.complete_store(group, ok=rng.random() < 0.8)
            write = control.plan_nvme_copy(pool, wanted, NS.fingerprint_hex) if wanted else None
            if write is not None:
                open_writes.append(write)
        elif action == 2 and open_writes:
            control.complete_nvme_write(open_writes.pop(rng.randrange(len(open_writes))), ok=rng.random() < 0.8)
        elif action == 3:
            key = rng.choice(universe)
            if pool.state(key, ns) is ChunkState.NVME_READY:
                promotion = control.plan_promotion(pool, key, ns)
                if not isinstance(promotion, bool):
                    open_promotions.append(promotion)
        elif action == 4 and open_promotions:
            promotion = open_promotions.pop(rng.randrange(len(open_promotions)))
            control.complete_promotion(promotion, rng.choice(list(PromotionOutcome)))
        elif action == 5:
            key = rng.choice(universe)
            if pool.state(key, ns) is ChunkState.CPU_READY:
                if rng.random() < 0.5:
                    control.lease(pool, key)
                else:
                    control.pin(pool, key)
                    pins.append(key)
        elif pins:
            control.unpin(pool, pins.pop())
            control.end_step()
        control.verify_invariants()
    for group in open_groups:
        control.complete_store(group, ok=False)
    for write in open_writes:
        control.complete_nvme_write(write, ok=False)
    for promotion in open_promotions:
        control.complete_promotion(promotion, PromotionOutcome.FAILED)
    for key in pins:
        control.unpin(pool, key)
    control.verify_invariants()
    assert pool.cpu.pinned == 0 and (pool.nvme is None or pool.nvme.pinned == 0)


@settings(max_examples=200, deadline=None)
@given(
    picks=st.lists(st.integers(0, 9), max_size=10),
    resident=st.sets(st.integers(0, 9), max_size=4),
    extra_blocks=st.integers(-2 * K, K),
    dropped=st.sets(st.integers(0, 12 * K), max_size=3),
)
def test_a_store_plans_every_chunk_the_rule_admits_and_counts_every_other_as_skipped(
    picks: list[int], resident: set[int], extra_blocks: int, dropped: set[int]
) -> None:
    """The rule, chunk by chunk: a chunk is stored when the table names all of its
    blocks, none of them dropped (negative), and its key is neither resident nor seen
    earlier in the call; every other chunk is skipped."""
    control, pool = plane(cpu=64, nvme=8)
    universe = keys(10)
    stored(control, pool, [universe[i] for i in sorted(resident)])
    prompt = [universe[i] for i in picks]
    table = [-1 if b in dropped else b for b in range(max(0, len(prompt) * K + extra_blocks))]
    expected, positions, seen = [], [], set()
    for c, key in enumerate(prompt):
        blocks = tuple(table[c * K : (c + 1) * K])
        if len(blocks) == K and min(blocks) >= 0 and key not in seen and universe.index(key) not in resident:
            seen.add(key)
            expected.append((key, blocks))
            positions.append(c)
    plan = control.plan_store(NS, [prompt], [table])
    assert [chunk for group in plan.groups for chunk in group.chunks] == expected
    assert plan.skipped == len(prompt) - len(expected)
    # Each stored chunk continues the key at the position before it, when that key was
    # resident by then: stored before the call, or earlier in it.
    order = [key for key, _ in expected]
    for n, (key, c) in enumerate(zip(order, positions, strict=True)):
        before = prompt[c - 1] if c else None
        held = before is not None and (universe.index(before) in resident or before in order[:n])
        assert pool.cpu.parent(key) == (before if held else None)
    control.verify_invariants()

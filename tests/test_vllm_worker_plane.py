"""The vLLM worker's data plane: copy jobs between the engine's block tensors and this rank's
share of the cpu slab's slots, as vLLM's worker drives them (submit never blocks, finished is
polled, wait blocks for the jobs that still touch GPU blocks)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Sequence

import pytest
import torch

from tiered_kv.errors import TierClosedError, TieredKVError, TierIOError
from tiered_kv.integrations.vllm.worker_plane import (
    ChunkCopy,
    Direction,
    JobResult,
    WorkerDataPlane,
    load_copies,
    store_copies,
)
from tiered_kv.interfaces import TierStats, TransferOp
from tiered_kv.tiers.gpu import GpuTier
from tiered_kv.tiers.pinned_cpu import PinnedCpuTier

BPC = 4  # blocks per chunk
BLOCKS = 24
PAGE_BYTES = 2 * 2 * 2 * 8 * 4  # K and V × 2 tokens × 2 heads × 8 dims × float32: one layer's page
LAYERS = 2
SLOTS = 6
WORLD, RANK = 2, 1
RANK_BYTES = LAYERS * PAGE_BYTES * BPC


def block_tensors(seed: int) -> list[torch.Tensor]:
    """vLLM's canonical view of a KV cache: one (num_blocks, page) int8 tensor per layer."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(-128, 128, (BLOCKS, PAGE_BYTES), dtype=torch.int8, generator=gen) for _ in range(LAYERS)]


def chunk_bytes(tensors: Sequence[torch.Tensor], blocks: Sequence[int]) -> torch.Tensor:
    """Tensor-major: per layer, its page of each block in order."""
    return torch.cat([t[b].view(torch.uint8) for t in tensors for b in blocks])


def make_plane(tensors: list[torch.Tensor], **kwargs: object) -> tuple[WorkerDataPlane, PinnedCpuTier]:
    host = PinnedCpuTier(slot_bytes=WORLD * RANK_BYTES, num_slots=SLOTS, pin=False)
    for slot in range(SLOTS):
        host.view(slot).zero_()
    gpu = GpuTier(tensors, blocks_per_chunk=BPC)
    plane = WorkerDataPlane([gpu], [host], rank=RANK, rank_bytes=[RANK_BYTES], **kwargs)  # type: ignore[arg-type]
    return plane, host


def drain(plane: WorkerDataPlane, jobs: int, timeout: float = 30) -> list[JobResult]:
    results: list[JobResult] = []
    deadline = time.monotonic() + timeout
    while len(results) < jobs:
        results += plane.finished()
        assert time.monotonic() < deadline, f"only {len(results)} of {jobs} jobs finished"
        time.sleep(0.001)
    return results


def rank_share(host: PinnedCpuTier, slot: int, rank: int = RANK) -> torch.Tensor:
    return host.view(slot)[rank * RANK_BYTES : (rank + 1) * RANK_BYTES]


def test_a_store_then_a_load_round_trips_through_this_ranks_share_of_the_slots() -> None:
    tensors = block_tensors(0)
    plane, host = make_plane(tensors)
    try:
        # When a store copies two chunks into slots 4 and 1
        plane.submit(7, Direction.STORE, [[ChunkCopy(4, (3, 4, 5, 6)), ChunkCopy(1, (10, 0, 11, 2))]])
        [stored] = drain(plane, 1)
        # Then it reports its bytes, and this rank's share holds the blocks, tensor-major
        assert stored.job_id == 7 and stored.ok and stored.nbytes == 2 * BPC * LAYERS * PAGE_BYTES
        assert torch.equal(rank_share(host, 4), chunk_bytes(tensors, (3, 4, 5, 6)))
        assert torch.equal(rank_share(host, 1), chunk_bytes(tensors, (10, 0, 11, 2)))
        # and the other rank's share is untouched
        assert not rank_share(host, 4, rank=0).any()
        # When a load copies slot 4 back into four other blocks
        plane.submit(8, Direction.LOAD, [[ChunkCopy(4, (20, 21, 22, 23))]])
        [loaded] = drain(plane, 1)
        # Then those blocks hold the original blocks' bytes
        assert loaded.ok
        for src, dst in zip((3, 4, 5, 6), (20, 21, 22, 23), strict=True):
            assert all(torch.equal(t[src], t[dst]) for t in tensors)
    finally:
        plane.close()


async def test_close_closes_the_tiers_it_was_given() -> None:
    # With CUDA, closing the cpu tier is what unregisters the shared slab from CUDA.
    plane, host = make_plane(block_tensors(3))
    plane.close()
    with pytest.raises(TierClosedError):
        await host.read([TransferOp(buffer=torch.empty(8, dtype=torch.uint8), slot=0)])


def test_a_load_that_starts_mid_chunk_fills_only_its_blocks_from_the_right_offset() -> None:
    tensors = block_tensors(1)
    plane, _ = make_plane(tensors)
    try:
        plane.submit(1, Direction.STORE, [[ChunkCopy(0, (0, 1, 2, 3))]])
        drain(plane, 1)
        before = [t.clone() for t in tensors]
        # The engine's load starts at block 2 of the chunk (its first blocks are in its cache)
        plane.submit(2, Direction.LOAD, [[ChunkCopy(0, (12, 13), first_block=2)]])
        drain(plane, 1)
        for t, old in zip(tensors, before, strict=True):
            assert torch.equal(t[12], old[2]) and torch.equal(t[13], old[3])
            changed = [b for b in range(BLOCKS) if not torch.equal(t[b], old[b])]
            assert set(changed) <= {12, 13}
    finally:
        plane.close()


def test_vllms_store_spec_maps_onto_whole_chunks_per_group() -> None:
    # Two KV groups: the first stores two chunks, the second one; vLLM lists their blocks in a row
    copies = store_copies([5, 6, 7, 8, 1, 2, 3, 4, 9, 10, 11, 12], [8, 4], [(3, 0), (2,)], blocks_per_chunk=4)
    assert copies == [
        [ChunkCopy(3, (5, 6, 7, 8)), ChunkCopy(0, (1, 2, 3, 4))],
        [ChunkCopy(2, (9, 10, 11, 12))],
    ]
    with pytest.raises(TieredKVError, match="3 GPU blocks to store into 1 chunks"):
        store_copies([1, 2, 3], [3], [(0,)], blocks_per_chunk=4)


def test_vllms_load_spec_maps_a_load_that_starts_inside_its_first_chunk() -> None:
    # The engine holds the first block of chunk 1: vLLM's blocks start at block index 5
    copies = load_copies([20, 21, 22, 30, 31, 32, 33], [7], [5], [(4, 9)], blocks_per_chunk=4)
    assert copies == [[ChunkCopy(4, (20, 21, 22), first_block=1), ChunkCopy(9, (30, 31, 32, 33))]]
    assert load_copies([], [0], [0], [()], blocks_per_chunk=4) == [[]]
    with pytest.raises(TieredKVError, match="do not map onto"):
        load_copies([1, 2, 3, 4, 5], [5], [0], [(0,)], blocks_per_chunk=4)
    with pytest.raises(TieredKVError, match="GPU blocks for groups"):
        load_copies([1, 2], [3], [0], [(0,)], blocks_per_chunk=4)


class GatedGpu:
    """A gpu tier whose copies wait for the test to let them through, recording their order."""

    name = "gpu"
    slot_bytes = PAGE_BYTES
    num_slots = BLOCKS

    def __init__(self, fail_blocks: frozenset[int] = frozenset()) -> None:
        self.gates: dict[int, threading.Event] = {}
        self.order: list[int] = []
        self.fail_blocks = fail_blocks

    def gate(self, block: int) -> threading.Event:
        return self.gates.setdefault(block, threading.Event())

    async def _copy(self, ops: Sequence[TransferOp]) -> None:
        block = ops[0].blocks[0]
        await asyncio.to_thread(self.gate(block).wait)
        self.order.append(block)
        if block in self.fail_blocks:
            raise TierIOError("copy: injected", tier="gpu")

    read = write = _copy

    def statistics(self) -> TierStats:
        return TierStats(name="gpu", slot_bytes=self.slot_bytes, num_slots=self.num_slots)

    async def close(self) -> None:
        return


def gated_plane(gpu: GatedGpu, copy_concurrency: int = 2) -> WorkerDataPlane:
    host = PinnedCpuTier(slot_bytes=WORLD * RANK_BYTES, num_slots=SLOTS, pin=False)
    return WorkerDataPlane(
        [gpu],  # type: ignore[list-item]
        [host],
        rank=RANK,
        rank_bytes=[RANK_BYTES],
        copy_concurrency=copy_concurrency,
    )


def test_submit_returns_at_once_and_wait_returns_only_when_the_job_is_done() -> None:
    gpu = GatedGpu()
    plane = gated_plane(gpu)
    try:
        started = time.monotonic()
        plane.submit(1, Direction.STORE, [[ChunkCopy(0, (5,))]])
        assert time.monotonic() - started < 5  # it did not wait for the (gated) copy
        assert plane.finished() == [] and plane.in_flight == 1
        waiter = threading.Thread(target=plane.wait, args=({1, 99},))  # 99: not in flight, ignored
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive(), "wait returned while the job still read GPU blocks"
        gpu.gate(5).set()
        waiter.join(10)
        assert not waiter.is_alive()
        # wait does not swallow the result: finished still reports the job
        assert [r.job_id for r in drain(plane, 1)] == [1]
    finally:
        for event in gpu.gates.values():
            event.set()
        plane.close()


def test_loads_go_before_stores_that_wait_and_expedited_loads_before_both() -> None:
    gpu = GatedGpu()
    plane = gated_plane(gpu, copy_concurrency=1)
    try:
        plane.submit(1, Direction.STORE, [[ChunkCopy(0, (1,))]])  # holds the only copy slot
        time.sleep(0.1)
        plane.submit(2, Direction.STORE, [[ChunkCopy(1, (2,))]])
        plane.submit(3, Direction.LOAD, [[ChunkCopy(2, (3,))]])
        plane.submit(4, Direction.LOAD, [[ChunkCopy(3, (4,))]], expedited=True)
        time.sleep(0.1)
        for block in (1, 2, 3, 4):
            gpu.gate(block).set()
        drain(plane, 4)
        assert gpu.order == [1, 4, 3, 2]
    finally:
        plane.close()


def test_a_failed_copy_is_reported_not_raised_and_later_jobs_still_run() -> None:
    gpu = GatedGpu(fail_blocks=frozenset({6}))
    for block in (6, 7):
        gpu.gate(block).set()
    plane = gated_plane(gpu)
    try:
        plane.submit(1, Direction.LOAD, [[ChunkCopy(0, (6,))]])
        plane.submit(2, Direction.LOAD, [[ChunkCopy(0, (7,))]])
        results = {r.job_id: r for r in drain(plane, 2)}
        assert not results[1].ok and results[1].nbytes == 0
        assert results[2].ok
    finally:
        plane.close()


def test_a_malformed_job_raises_at_submit_before_anything_is_copied() -> None:
    plane, _ = make_plane(block_tensors(2))
    try:
        with pytest.raises(ValueError, match="outside"):
            plane.submit(1, Direction.STORE, [[ChunkCopy(SLOTS, (0, 1, 2, 3))]])
        with pytest.raises(TieredKVError, match="KV groups"):
            plane.submit(2, Direction.STORE, [])
        plane.submit(3, Direction.STORE, [[ChunkCopy(0, (0, 1, 2, 3))]])
        with pytest.raises(TieredKVError, match="twice"):
            plane.submit(3, Direction.STORE, [[ChunkCopy(1, (0, 1, 2, 3))]])
        assert [r.job_id for r in drain(plane, 1)] == [3]
    finally:
        plane.close()
    with pytest.raises(TieredKVError, match="closed"):
        plane.submit(4, Direction.STORE, [[ChunkCopy(0, (0, 1, 2, 3))]])


@pytest.mark.parametrize("seed", range(4))
def test_random_jobs_as_vllm_issues_them_keep_every_slot_and_block_exact(seed: int) -> None:
    # Stores of random blocks into slots no job is using, loads (whole, or from a random
    # position in the chunk) of stored slots into blocks no job is using, finished() polled
    # and wait() called at random, as vLLM's worker does: every slot and every loaded block
    # always matches a reference model.
    # Stores read the first half of the blocks, loads write the second half, so a store's
    # bytes are always the original ones.
    sources, targets = range(BLOCKS // 2), range(BLOCKS // 2, BLOCKS)
    rng = random.Random(seed)
    tensors = block_tensors(seed)
    originals = [t.clone() for t in tensors]
    plane, host = make_plane(tensors)
    model: dict[int, torch.Tensor] = {}  # slot → the bytes its last store wrote
    ready: set[int] = set()  # slots whose store has finished
    loaded: dict[int, torch.Tensor] = {}  # block → the pages its last load wrote (one per layer)
    running: dict[int, tuple[Direction, int, set[int]]] = {}  # job → direction, slot, blocks

    def settle(results: list[JobResult]) -> None:
        for result in results:
            assert result.ok
            direction, slot, _ = running.pop(result.job_id)
            if direction is Direction.STORE:
                ready.add(slot)

    try:
        for job in range(80):
            busy_slots = {slot for _, slot, _ in running.values()}
            busy_blocks = set().union(*(blocks for _, _, blocks in running.values()))
            loadable = sorted(ready - busy_slots)
            if len(set(targets) - busy_blocks) < BPC:
                plane.wait(set(running))
                settle(plane.finished())
                continue
            if loadable and rng.random() < 0.5:
                slot = rng.choice(loadable)
                first = rng.randrange(BPC)
                blocks = tuple(rng.sample(sorted(set(targets) - busy_blocks), BPC - first))
                plane.submit(job, Direction.LOAD, [[ChunkCopy(slot, blocks, first_block=first)]])
                pages = model[slot].view(LAYERS, BPC, PAGE_BYTES)
                for i, block in enumerate(blocks):
                    loaded[block] = pages[:, first + i].clone()
                running[job] = (Direction.LOAD, slot, set(blocks))
            else:
                free_slots = sorted(set(range(SLOTS)) - busy_slots)
                if not free_slots:
                    plane.wait(set(running))
                    settle(plane.finished())
                    continue
                slot = rng.choice(free_slots)
                blocks = tuple(rng.sample(sources, BPC))
                ready.discard(slot)
                model[slot] = chunk_bytes(originals, blocks)
                plane.submit(job, Direction.STORE, [[ChunkCopy(slot, blocks)]])
                running[job] = (Direction.STORE, slot, set(blocks))
            if rng.random() < 0.2:
                plane.wait(set(rng.sample(sorted(running), k=min(2, len(running)))))
            settle(plane.finished())
        plane.wait(set(running))
        settle(drain(plane, len(running)))
        for slot in ready:
            assert torch.equal(rank_share(host, slot), model[slot]), f"slot {slot}"
        for block, pages in loaded.items():
            for layer, t in enumerate(tensors):
                assert torch.equal(t[block].view(torch.uint8), pages[layer]), f"block {block} layer {layer}"
    finally:
        plane.close()

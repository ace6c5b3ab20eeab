"""The worker's data plane: copy jobs between the engine's GPU blocks and the cpu slab.

vLLM's worker calls its offloading backend synchronously, once or twice per engine step:
submit a store or a load (which must not block and must not refuse), poll what has
finished, and, before it reuses the GPU blocks of a preempted or finished request, wait
for the jobs that still read them. :class:`WorkerDataPlane` is that job queue over the
gpu tier driver's copy code, which runs on an event loop of its own thread: with CUDA a
copy stream that waits for the compute stream and one event per job, without CUDA copies
in worker threads.

Each job is a list of chunk copies per KV group; a chunk copy names the cpu slot, the GPU
block ids in chunk order and the position of the first of them inside the chunk (a load
that starts in the middle of a chunk reads only the rest of it). The worker copies only
its own part of each slot: rank ``r`` of the engine owns bytes ``r·n … (r+1)·n`` of a
slot, ``n`` being one rank's chunk bytes.

Loads go before stores (a load is on some request's time to first token, a store is
not); what is in flight is bounded by the engine core, which plans every job.
"""

from __future__ import annotations

import collections
import concurrent.futures
import enum
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from tiered_kv.errors import TieredKVError
from tiered_kv.integrations.vllm.loop_thread import LoopThread
from tiered_kv.interfaces import HostTier, TierDriver, TransferOp
from tiered_kv.log import get_logger
from tiered_kv.scheduler import LOAD_PRIORITY, STORE_PRIORITY, PriorityGate

log = get_logger("vllm.worker")

#: Priority of a load the engine's step waits for (vLLM 0.33's ``expedited``).
EXPEDITED_PRIORITY = LOAD_PRIORITY - 1


class Direction(enum.Enum):
    #: GPU blocks → cpu slots.
    STORE = "store"
    #: cpu slots → GPU blocks.
    LOAD = "load"


class ChunkCopy(NamedTuple):
    """One chunk's share of a job: a cpu slot and the GPU blocks it maps to."""

    slot: int
    #: GPU block ids, in chunk order, starting at position ``first_block`` of the chunk.
    blocks: tuple[int, ...]
    first_block: int = 0


class JobResult(NamedTuple):
    job_id: int
    ok: bool
    #: Bytes this worker copied.
    nbytes: int
    seconds: float


def _group_blocks(block_ids: Sequence[int], group_sizes: Sequence[int]) -> list[Sequence[int]]:
    """vLLM's flat block list cut into one run per KV group."""
    if sum(group_sizes) != len(block_ids):
        raise TieredKVError(f"{len(block_ids)} GPU blocks for groups of {list(group_sizes)}")
    runs, start = [], 0
    for size in group_sizes:
        runs.append(block_ids[start : start + size])
        start += size
    return runs


def store_copies(
    block_ids: Sequence[int],
    group_sizes: Sequence[int],
    slots: Sequence[Sequence[int]],
    *,
    blocks_per_chunk: int,
) -> list[list[ChunkCopy]]:
    """The chunk copies of a store: group ``g`` copies ``blocks_per_chunk`` blocks per chunk,
    chunk after chunk, into ``slots[g]`` (vLLM lists the blocks of the stored chunks only,
    in prefix order)."""
    copies = []
    for g, (blocks, group_slots) in enumerate(zip(_group_blocks(block_ids, group_sizes), slots, strict=True)):
        if len(blocks) != blocks_per_chunk * len(group_slots):
            raise TieredKVError(
                f"group {g}: {len(blocks)} GPU blocks to store into {len(group_slots)} chunks of {blocks_per_chunk}"
            )
        copies.append(
            [
                ChunkCopy(slot, tuple(int(b) for b in blocks[i * blocks_per_chunk : (i + 1) * blocks_per_chunk]))
                for i, slot in enumerate(group_slots)
            ]
        )
    return copies


def load_copies(
    block_ids: Sequence[int],
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    slots: Sequence[Sequence[int]],
    *,
    blocks_per_chunk: int,
) -> list[list[ChunkCopy]]:
    """The chunk copies of a load: group ``g``'s blocks are the request's blocks from
    position ``block_indices[g]`` on, which may lie inside the first chunk (the engine's
    own cache holds that chunk's first blocks); the chunks are ``slots[g]`` in order."""
    copies = []
    for g, (blocks, first, group_slots) in enumerate(
        zip(_group_blocks(block_ids, group_sizes), block_indices, slots, strict=True)
    ):
        group: list[ChunkCopy] = []
        cursor = 0
        offset = int(first) % blocks_per_chunk
        for slot in group_slots:
            count = min(blocks_per_chunk - offset, len(blocks) - cursor)
            if count <= 0:
                break
            group.append(ChunkCopy(slot, tuple(int(b) for b in blocks[cursor : cursor + count]), offset))
            cursor += count
            offset = 0
        if cursor != len(blocks) or len(group) != len(group_slots):
            raise TieredKVError(
                f"group {g}: {len(blocks)} GPU blocks from position {first} do not map onto {len(group_slots)} chunks"
            )
        copies.append(group)
    return copies


class WorkerDataPlane:
    """Copy jobs of one worker (one rank) over its gpu tiers and its part of the slab.

    ``gpus[g]`` and ``hosts[g]`` are KV group ``g``'s gpu tier (over this rank's tensors)
    and cpu tier (over the slab); ``rank_bytes[g]`` is one rank's share of a slot.
    """

    def __init__(
        self,
        gpus: Sequence[TierDriver],
        hosts: Sequence[HostTier],
        *,
        rank: int,
        rank_bytes: Sequence[int],
        copy_concurrency: int = 2,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not len(gpus) == len(hosts) == len(rank_bytes):
            raise TieredKVError(f"{len(gpus)} gpu tiers, {len(hosts)} cpu tiers, {len(rank_bytes)} slot shares")
        self._gpus = list(gpus)
        self._hosts = list(hosts)
        self._rank = rank
        self._rank_bytes = list(rank_bytes)
        self._clock = clock
        self._gate = PriorityGate(copy_concurrency)
        self._loop = LoopThread(f"tiered-kv-worker-{rank}")
        #: Jobs submitted and not yet reported by :meth:`finished`.
        self._jobs: dict[int, concurrent.futures.Future[JobResult]] = {}
        #: Results in completion order, appended by the loop thread.
        self._done: collections.deque[JobResult] = collections.deque()
        self._lock = threading.Lock()
        self._closed = False

    def submit(
        self, job_id: int, direction: Direction, copies: Sequence[Sequence[ChunkCopy]], *, expedited: bool = False
    ) -> None:
        """Start job ``job_id`` (``copies[g]``: group ``g``'s chunks); returns at once.

        A malformed job (a slot or block id out of range, blocks that do not fit a chunk)
        is a bug of whoever planned it and raises here, before anything is copied.
        """
        if self._closed:
            raise TieredKVError("the worker's data plane is closed")
        if job_id in self._jobs:
            raise TieredKVError(f"job {job_id} was submitted twice")
        if len(copies) != len(self._gpus):
            raise TieredKVError(f"job {job_id} has copies for {len(copies)} KV groups, not {len(self._gpus)}")
        ops = [[self._op(g, copy) for copy in group] for g, group in enumerate(copies)]
        priority = (
            STORE_PRIORITY if direction is Direction.STORE else EXPEDITED_PRIORITY if expedited else LOAD_PRIORITY
        )
        with self._lock:  # registered before it can finish, for a finished() on another thread
            future = self._loop.submit(self._run(job_id, direction, ops, priority))
            self._jobs[job_id] = future
        future.add_done_callback(self._finish)

    def _op(self, group: int, copy: ChunkCopy) -> TransferOp:
        share = self._rank_bytes[group]
        buffer = self._hosts[group].view(copy.slot)[self._rank * share : (self._rank + 1) * share]
        if buffer.numel() != share:
            raise TieredKVError(f"slot {copy.slot} of group {group} has no room for rank {self._rank}'s share")
        return TransferOp(buffer=buffer, slot=copy.slot, blocks=tuple(copy.blocks), first_block=copy.first_block)

    async def _run(self, job_id: int, direction: Direction, ops: list[list[TransferOp]], priority: int) -> JobResult:
        started = self._clock()
        nbytes = sum(
            len(op.blocks) * gpu.slot_bytes for gpu, group in zip(self._gpus, ops, strict=True) for op in group
        )
        try:
            async with self._gate.hold(priority):
                for gpu, group in zip(self._gpus, ops, strict=True):
                    if not group:
                        continue
                    if direction is Direction.STORE:
                        await gpu.read(group)
                    else:
                        await gpu.write(group)
        except Exception as exc:
            # vLLM cannot take a failed transfer (it asserts success): say why, loudly.
            log.error("transfer.failed", job_id=job_id, direction=direction.value, error=repr(exc))
            return JobResult(job_id, False, 0, self._clock() - started)
        return JobResult(job_id, True, nbytes, self._clock() - started)

    def _finish(self, future: concurrent.futures.Future[JobResult]) -> None:
        if future.cancelled():
            return
        self._done.append(future.result())

    def finished(self) -> list[JobResult]:
        """Jobs finished since the last call, in the order they finished; never blocks."""
        results = []
        while self._done:
            result = self._done.popleft()
            with self._lock:
                self._jobs.pop(result.job_id, None)
            results.append(result)
        return results

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the jobs ``job_ids`` (those still in flight) no longer touch GPU
        memory; :meth:`finished` still reports them."""
        with self._lock:
            futures = [self._jobs[job_id] for job_id in job_ids if job_id in self._jobs]
        concurrent.futures.wait(futures)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return sum(1 for future in self._jobs.values() if not future.done())

    def close(self) -> None:
        """Wait for the jobs in flight (they touch GPU memory), then close the gpu and cpu
        tiers and stop the copy thread."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            pending = list(self._jobs.values())
        concurrent.futures.wait(pending)

        async def close_tiers() -> None:
            for tier in [*self._gpus, *self._hosts]:
                await tier.close()  # the cpu tiers unregister the slab from CUDA

        try:
            self._loop.run(close_tiers())
        finally:
            self._loop.close()

    def __repr__(self) -> str:
        return f"<WorkerDataPlane rank={self._rank} groups={len(self._gpus)} in_flight={self.in_flight}>"

"""vLLM's worker-side offloading interface over the worker's data plane.

vLLM's worker hands over each transfer as a ``GPULoadStoreSpec`` (its block ids per KV
group, and where a load starts inside its first chunk) and the manager's
:class:`~tiered_kv.integrations.vllm.records.HostSlots`; this module turns the pair into
chunk copies for :class:`~tiered_kv.integrations.vllm.worker_plane.WorkerDataPlane`.
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import GPULoadStoreSpec, LoadStoreSpec, OffloadingWorker, TransferResult

from tiered_kv.errors import TieredKVError
from tiered_kv.integrations.vllm.records import HostSlots
from tiered_kv.integrations.vllm.slab import Slab
from tiered_kv.integrations.vllm.worker_plane import Direction, WorkerDataPlane, load_copies, store_copies
from tiered_kv.log import get_logger

log = get_logger("vllm.worker")


def _slots(spec: LoadStoreSpec) -> tuple[tuple[int, ...], ...]:
    if not isinstance(spec, HostSlots):
        raise TieredKVError(f"a tiered-kv transfer names HostSlots, not {type(spec).__name__}")
    return spec.slots


class TieredKVWorker(OffloadingWorker):
    """One rank's transfers: submit never blocks and never refuses (vLLM asserts it)."""

    def __init__(self, plane: WorkerDataPlane, slab: Slab, *, blocks_per_chunk: int) -> None:
        self._plane = plane
        self._slab = slab
        self._blocks_per_chunk = blocks_per_chunk

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        copies = store_copies(
            src_spec.block_ids.tolist(),
            src_spec.group_sizes,
            _slots(dst_spec),
            blocks_per_chunk=self._blocks_per_chunk,
        )
        self._plane.submit(job_id, Direction.STORE, copies)
        return True

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        copies = load_copies(
            dst_spec.block_ids.tolist(),
            dst_spec.group_sizes,
            dst_spec.block_indices,
            _slots(src_spec),
            blocks_per_chunk=self._blocks_per_chunk,
        )
        self._plane.submit(job_id, Direction.LOAD, copies, expedited=expedited)
        return True

    def get_finished(self) -> list[TransferResult]:
        return [
            TransferResult(job_id=r.job_id, success=r.ok, transfer_size=r.nbytes, transfer_time=r.seconds)
            for r in self._plane.finished()
        ]

    def wait(self, job_ids: set[int]) -> None:
        self._plane.wait(job_ids)

    def shutdown(self) -> None:
        self._plane.close()
        self._slab.unlink()  # the engine core unlinks it; a worker whose core never came does

"""The vLLM adapter's translation layer against vLLM's own types (no engine): the manager's
answers as vLLM's enums and records, the worker's transfers from vLLM's GPU specs, the record
that crosses to the workers, the spec's checks at start-up. Runs where vLLM is installed (the
engine venv; scripts/test runs it there)."""

from __future__ import annotations

import pickle
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

pytest.importorskip("vllm")

import torch
from conftest import make_namespace
from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    Medium,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tiered_kv.config import NamespacePolicyConfig
from tiered_kv.control import ControlPlane, Pool
from tiered_kv.errors import ConfigError
from tiered_kv.integrations.vllm import TieredKVOffloadingSpec, compat
from tiered_kv.integrations.vllm.manager import TENANT_PARAM, TieredKVManager
from tiered_kv.integrations.vllm.records import HostSlots
from tiered_kv.integrations.vllm.scheduler_side import RequestState, SchedulerSide
from tiered_kv.integrations.vllm.slab import Slab, plan_layout, slab_path
from tiered_kv.integrations.vllm.worker import TieredKVWorker
from tiered_kv.integrations.vllm.worker_plane import WorkerDataPlane
from tiered_kv.telemetry import Telemetry
from tiered_kv.tiers.gpu import GpuTier
from tiered_kv.tiers.pinned_cpu import PinnedCpuTier

pytestmark = pytest.mark.vllm

NAMESPACE = make_namespace()
BPC = NAMESPACE.geometry.blocks_per_chunk
GROUP_ID = 0


def key(chunk: int) -> Any:
    return make_offload_key(bytes([chunk]) * 32, GROUP_ID)


def make_manager(cpu_chunks: int = 8, *, track_keys: bool = False) -> TieredKVManager:
    telemetry = Telemetry(1024)

    def open_pools() -> tuple[ControlPlane, list[Pool]]:
        control = ControlPlane(telemetry, max_tenants=8)
        return control, control.add_pools(NAMESPACE, NamespacePolicyConfig(), cpu_chunks, 0)

    side = SchedulerSide(
        NAMESPACE,
        open_pools,
        telemetry,
        group_ids=[GROUP_ID],
        core=None,
        nvme_slots=0,
        promotion_deadline_s=5,
        max_store_chunks=64,
        track_keys=track_keys,
    )
    return TieredKVManager(side)


def test_the_record_that_crosses_to_the_workers_pickles_and_round_trips_msgpack() -> None:
    slots = HostSlots(slots=((3, 1), (2,)))
    assert isinstance(slots, LoadStoreSpec)
    assert pickle.loads(pickle.dumps(slots)) == slots
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(slots), type=HostSlots) == slots


def test_the_manager_answers_in_vllms_terms_through_a_store_and_a_load() -> None:
    manager = make_manager(track_keys=True)
    writer = ReqContext(req_id="w")
    manager.on_new_request(writer)
    assert manager.lookup(key(0), writer) is LookupResult.MISS
    output = manager.prepare_store([key(0), key(1)], writer)
    assert output is not None and output.keys_to_store == [key(0), key(1)]
    assert isinstance(output.store_spec, HostSlots) and len(output.store_spec.slots[0]) == 2
    manager.complete_store(output.keys_to_store, writer)
    [event] = manager.take_events()
    assert (event.keys, event.medium, event.removed) == ([key(0), key(1)], Medium.CPU, False)
    reader = ReqContext(req_id="r")
    manager.on_new_request(reader)
    assert [manager.lookup(k, reader) for k in (key(0), key(1), key(2))] == [
        LookupResult.HIT,
        LookupResult.HIT,
        LookupResult.MISS,
    ]
    assert manager.get_load_source(key(0), reader) is CacheHitSource.HOST
    spec = manager.prepare_load([key(0), key(1)], reader)
    assert spec.slots == output.store_spec.slots
    manager.complete_load([key(0), key(1)], reader)
    manager.on_schedule_end(None)  # type: ignore[arg-type]
    manager.on_request_finished(reader)
    assert not manager.has_pending_work()


def test_a_request_names_its_tenant_in_kv_transfer_params() -> None:
    manager = make_manager()
    acme = ReqContext(req_id="a", kv_transfer_params={TENANT_PARAM: "acme"})
    manager.on_new_request(acme)
    output = manager.prepare_store([key(0)], acme)
    assert output is not None
    manager.complete_store(output.keys_to_store, acme)
    other = ReqContext(req_id="b")
    manager.on_new_request(other)
    assert manager.lookup(key(0), other) is LookupResult.MISS
    again = ReqContext(req_id="c", kv_transfer_params={TENANT_PARAM: "acme"})
    assert manager.lookup(key(0), again) is LookupResult.HIT  # a context vLLM made without on_new_request
    state = again.get_state(RequestState)
    assert state is not None and state.namespace.cache_salt == "tenant:acme"


def test_the_worker_runs_vllms_transfers_and_reports_them_as_it_expects(tmp_path: Path) -> None:
    layers = [torch.randint(-128, 128, (16, 512), dtype=torch.int8) for _ in range(2)]
    gpu = GpuTier(layers, blocks_per_chunk=BPC)
    layout = plan_layout([2 * 512 * BPC], world_size=1, capacity_bytes=1 << 20)
    slab = Slab.join(slab_path(tmp_path, "e"), layout, timeout_s=1)
    cpu = PinnedCpuTier(layout.groups[0].slot_bytes, layout.num_slots, pin=False, buffer=slab.region(0))
    plane = WorkerDataPlane([gpu], [cpu], rank=0, rank_bytes=[layout.groups[0].rank_bytes])
    worker = TieredKVWorker(plane, slab, blocks_per_chunk=BPC)
    blocks = list(range(BPC))
    assert worker.submit_store(1, GPULoadStoreSpec(blocks, [BPC], [0]), HostSlots(slots=((5,),)))
    worker.wait({1})  # as before a load of the chunk: vLLM loads only chunks whose store completed
    # vLLM 0.33 passes expedited; 0.32 does not
    targets = list(range(BPC + 1, 2 * BPC))
    assert worker.submit_load(
        2, HostSlots(slots=((5,),)), GPULoadStoreSpec(targets, [BPC - 1], [BPC + 1]), expedited=True
    )
    results: list[Any] = []
    deadline = time.monotonic() + 30
    while len(results) < 2 and time.monotonic() < deadline:
        results += worker.get_finished()
        time.sleep(0.001)
    assert [r.job_id for r in results] == [1, 2] and all(r.success for r in results)
    assert all(r.transfer_size > 0 and r.transfer_time >= 0 for r in results)
    for t in layers:  # the load started at position 1 of the chunk: blocks 1..3 landed in 5..7
        assert torch.equal(t[1:BPC], t[BPC + 1 : 2 * BPC])
    worker.wait({1, 2})
    worker.shutdown()
    assert not slab.path.exists()


def offloading_config(extra: dict[str, Any]) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=32, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=65536,
        enable_kv_cache_events=False,
        extra_config={"spec_name": "TieredKVOffloadingSpec", "spec_module_path": "tiered_kv.integrations.vllm"} | extra,
        engine_id="e",
        model=OffloadingModelConfig(name="m", dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=4),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


def test_the_spec_checks_its_settings_when_vllm_builds_it() -> None:
    with pytest.raises(ConfigError, match="unknown key"):
        TieredKVOffloadingSpec(offloading_config({"tiered_kv": {"cpu": {"capacity_bytes": 1}}, "cpu_bytes": 1}))
    spec = TieredKVOffloadingSpec(
        offloading_config(
            {"tiered_kv": {"cpu": {"capacity_bytes": 1 << 20}, "default_policy": {"write_policy": "write_back"}}}
        )
    )
    with pytest.raises(ConfigError, match="write_back is not supported"):
        spec.get_manager()


def test_the_engine_core_without_workers_says_so_instead_of_missing_silently(tmp_path: Path) -> None:
    spec = TieredKVOffloadingSpec(
        offloading_config(
            {"tiered_kv": {"cpu": {"capacity_bytes": 1 << 20}}, "slab_dir": str(tmp_path), "startup_timeout_s": 0.05}
        )
    )
    with pytest.raises(ConfigError, match="no worker created the cpu slab"):
        spec.get_manager()


def test_features_of_the_installed_vllm_are_detected() -> None:
    assert compat.VLLM_VERSION.startswith(("0.32", "0.33"))
    assert compat.VLLM_VERSION.startswith("0.33") == compat.HAS_RESET_FLUSHED

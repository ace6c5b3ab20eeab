"""tiered-kv as a vLLM offloading backend: the ``OffloadingSpec`` vLLM loads by name.

vLLM builds the spec in every worker process (``get_worker``: the GPU copies) and in the
engine-core process (``get_manager``: the control plane and the nvme tier), in that
order. The workers create the shared cpu slab and describe the KV cache in its header;
the engine core, which sees neither the model's geometry nor the tensors, reads it from
there (``docs/vllm.md``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingSpec, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig

from tiered_kv.config import TieredKVConfig, WritePolicy
from tiered_kv.control import ControlPlane, Pool
from tiered_kv.errors import ConfigError
from tiered_kv.integrations.vllm.compat import HAS_RESET_FLUSHED, VLLM_VERSION
from tiered_kv.integrations.vllm.core_plane import CoreDataPlane
from tiered_kv.integrations.vllm.engine_namespace import engine_facts, engine_namespace
from tiered_kv.integrations.vllm.manager import TieredKVManager
from tiered_kv.integrations.vllm.scheduler_side import SchedulerSide
from tiered_kv.integrations.vllm.settings import parse_settings
from tiered_kv.integrations.vllm.slab import RankRecord, Slab, SlabLayout, plan_layout, slab_path
from tiered_kv.integrations.vllm.worker import TieredKVWorker
from tiered_kv.integrations.vllm.worker_plane import WorkerDataPlane
from tiered_kv.interfaces import HostTier, TierDriver
from tiered_kv.log import get_logger
from tiered_kv.registry import TIERS
from tiered_kv.telemetry import Telemetry

log = get_logger("vllm.spec")

#: KV events the engine core keeps for vLLM between two ``take_events`` calls.
MAX_EVENTS = 65536
#: Tenants with a share of their own per pool (beyond it they share the model's).
MAX_TENANTS = 1024


class TieredKVOffloadingSpec(OffloadingSpec):
    """``kv_connector_extra_config={"spec_name": "TieredKVOffloadingSpec",
    "spec_module_path": "tiered_kv.integrations.vllm", "tiered_kv": {...}}``."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.settings = parse_settings(self.extra_config)
        self._manager: TieredKVManager | None = None
        self._worker: TieredKVWorker | None = None

    def _config(self) -> TieredKVConfig:
        config = self.settings.config()
        for model, policy in [("default_policy", config.default_policy), *config.namespaces.items()]:
            if policy.write_policy is WritePolicy.WRITE_BACK:
                # A store's victims would have to reach nvme before a worker overwrites
                # their slots, and the workers copy as soon as vLLM tells them.
                raise ConfigError(
                    "write_back is not supported under vLLM; use write_through or selective",
                    field=f"tiered_kv.{'' if model == 'default_policy' else 'namespaces.'}{model}.write_policy",
                )
        return config

    def _slab_path(self) -> Path:
        return slab_path(self.settings.slab_dir, self.config.engine_id)

    # -- worker side ---------------------------------------------------------------------
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = self._build_worker(kv_caches)
        return self._worker

    def _build_worker(self, kv_caches: CanonicalKVCaches) -> TieredKVWorker:
        from vllm.config import get_current_vllm_config
        from vllm.platforms import current_platform

        config = self._config()
        vllm_config = get_current_vllm_config()
        facts = engine_facts(vllm_config, self.config, VLLM_VERSION, str(current_platform.device_type))
        refs = kv_caches.group_data_refs
        page_bytes = [sum(ref.page_size_bytes for ref in group) for group in refs]
        namespace = engine_namespace(facts, page_bytes)
        hash_algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
        if not hash_algo.startswith("sha256") and os.environ.get("PYTHONHASHSEED") is None:
            # The key chain's seed is then random per process: no key survives a restart.
            log.warning("vllm.no_warm_restart", hash=hash_algo, reason="set PYTHONHASHSEED or use sha256")
        bpc = self.blocks_per_chunk
        policy = config.policy_for(namespace.model_id)
        capacity = policy.cpu_bytes or config.cpu.capacity_bytes
        layout = plan_layout([n * bpc for n in page_bytes], world_size=facts.world_size, capacity_bytes=capacity)
        slab = Slab.join(self._slab_path(), layout, timeout_s=self.settings.startup_timeout_s)
        try:
            hosts = _cpu_tiers(slab, layout, pin=None)
            gpus: list[TierDriver] = []
            for group in refs:
                tensors = [kv_caches.tensors[ref.tensor_idx].tensor[:, : ref.page_size_bytes] for ref in group]
                stream = torch.cuda.current_stream(tensors[0].device) if tensors[0].is_cuda else None
                gpus.append(TIERS.get("gpu")(tensors, blocks_per_chunk=bpc, compute_stream=stream))  # type: ignore[operator]
            rank = int(self.config.parallel.rank)
            plane = WorkerDataPlane(gpus, hosts, rank=rank, rank_bytes=[g.rank_bytes for g in layout.groups])
            slab.write_record(
                RankRecord(
                    rank=rank,
                    pid=os.getpid(),
                    namespace=namespace,
                    layout=layout,
                    engine={"vllm": VLLM_VERSION, "platform": facts.platform, "layout": facts.kv_cache_layout},
                )
            )
        except BaseException:
            slab.unlink()
            raise
        log.info(
            "vllm.worker_ready",
            rank=rank,
            namespace=namespace.fingerprint_hex,
            model=namespace.model_id,
            slots=layout.num_slots,
            slab=str(slab.path),
        )
        return TieredKVWorker(plane, slab, blocks_per_chunk=bpc)

    # -- engine-core side ----------------------------------------------------------------
    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = self._build_manager()
        return self._manager

    def _build_manager(self) -> TieredKVManager:
        config = self._config()
        slab, records = Slab.attach(
            self._slab_path(),
            world_size=int(self.config.parallel.world_size),
            timeout_s=self.settings.startup_timeout_s,
        )
        namespace = records[0].namespace
        layout = slab.layout
        assert layout is not None
        policy = config.policy_for(namespace.model_id)
        cpus = _cpu_tiers(slab, layout, pin=False)
        nvme_slots = 0
        if config.nvme is not None:
            nvme_bytes = policy.nvme_bytes or config.nvme.capacity_bytes
            nvme_slots = nvme_bytes // sum(g.slot_bytes for g in layout.groups)
            if not nvme_slots:
                raise ConfigError(
                    f"{nvme_bytes} bytes cannot hold one chunk of every KV group", field="tiered_kv.nvme.capacity_bytes"
                )
        telemetry = Telemetry(MAX_EVENTS)

        def open_pools() -> tuple[ControlPlane, list[Pool]]:
            control = ControlPlane(telemetry, max_tenants=MAX_TENANTS)
            return control, control.add_pools(namespace, policy, layout.num_slots, nvme_slots)

        core: CoreDataPlane[Any] | None = None
        if config.nvme is not None:
            core = CoreDataPlane(namespace, cpus, config.nvme, nvme_slots=nvme_slots)
        side = SchedulerSide(
            namespace,
            open_pools,
            telemetry,
            group_ids=[group.group_id for group in self.config.groups],
            core=core,
            nvme_slots=nvme_slots,
            promotion_deadline_s=self.settings.promotion_deadline_s,
            max_store_chunks=self.settings.max_store_chunks,
            track_keys=self.kv_events_config.enable_kv_cache_events,
            reset_fence=HAS_RESET_FLUSHED,
            statistics_path=self.settings.statistics_path,
            statistics_interval_s=self.settings.statistics_interval_s,
        )
        log.info(
            "vllm.manager_ready",
            namespace=namespace.fingerprint_hex,
            model=namespace.model_id,
            ranks=len(records),
            cpu_chunks=layout.num_slots,
            nvme_chunks=nvme_slots,
        )
        return TieredKVManager(side)


def _cpu_tiers(slab: Slab, layout: SlabLayout, *, pin: bool | None) -> list[HostTier]:
    """One cpu tier per KV group over the group's slots in the slab."""
    tiers: list[HostTier] = []
    for g, group in enumerate(layout.groups):
        tier: Any = TIERS.get("cpu")
        host: HostTier = tier(group.slot_bytes, layout.num_slots, pin=pin, buffer=slab.region(g))
        stride = getattr(host, "slot_stride", group.slot_stride)
        if stride != group.slot_stride:
            raise ConfigError(f"the cpu tier lays slots {stride} bytes apart, the slab {group.slot_stride}")
        tiers.append(host)
    return tiers

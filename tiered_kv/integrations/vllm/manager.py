"""vLLM's scheduler-side ``OffloadingManager`` over :class:`SchedulerSide`.

This module only translates: vLLM's per-request context carries the request's
:class:`~tiered_kv.integrations.vllm.scheduler_side.RequestState`, results become vLLM's
enums and records. Every decision is :class:`SchedulerSide`'s.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tiered_kv.integrations.vllm.records import HostSlots
from tiered_kv.integrations.vllm.scheduler_side import Answer, RequestState, SchedulerSide, Source

#: ``kv_transfer_params`` key naming the tenant whose share of the tiers a request uses.
TENANT_PARAM = "tiered_kv_tenant"

_ANSWERS = {Answer.HIT: LookupResult.HIT, Answer.HIT_PENDING: LookupResult.HIT_PENDING, Answer.MISS: LookupResult.MISS}
_SOURCES = {Source.HOST: CacheHitSource.HOST, Source.DISK: CacheHitSource.DISK}
_MEDIA = {"cpu": Medium.CPU, "nvme": Medium.STORAGE}


class TieredKVManager(OffloadingManager):
    """tiered-kv's control plane as vLLM's offloading manager (engine-core process)."""

    def __init__(self, side: SchedulerSide) -> None:
        self.side = side

    def _state(self, req_context: ReqContext) -> RequestState:
        state: RequestState | None = req_context.get_state(RequestState)
        if state is None:  # a context vLLM made without on_new_request
            state = self._new_state(req_context)
        return state

    def _new_state(self, req_context: ReqContext) -> RequestState:
        params = req_context.kv_transfer_params or {}
        tenant = params.get(TENANT_PARAM)
        state = self.side.new_request(str(tenant) if tenant is not None else None)
        req_context.set_state(state)
        return state

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._new_state(req_context)
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return _ANSWERS[self.side.lookup(self._state(req_context), key)]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return _SOURCES[self.side.load_source(self._state(req_context), key)]

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> HostSlots:
        return HostSlots(slots=self.side.prepare_load(self._state(req_context), req_context.req_id, keys))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.side.complete_load(req_context.req_id)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        answer = self.side.prepare_store(self._state(req_context), list(keys))
        if answer is None:
            return None
        return PrepareStoreOutput(
            keys_to_store=[OffloadKey(k) for k in answer.keys],
            store_spec=HostSlots(slots=answer.slots),
            evicted_keys=[OffloadKey(k) for k in answer.evicted],
        )

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        self.side.complete_store(keys, success)

    def on_request_finished(self, req_context: ReqContext) -> None:
        # The request's memo goes with its context; stores in flight complete on their own.
        return

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.side.schedule_end()

    def take_events(self) -> Iterable[OffloadingEvent]:
        return [
            OffloadingEvent(keys=[OffloadKey(k) for k in run.keys], medium=_MEDIA[run.tier], removed=run.removed)
            for run in self.side.take_events()
        ]

    def has_pending_work(self) -> bool:
        return self.side.has_pending_work()

    def reset_cache(self) -> None:
        self.side.reset()

    def on_reset_flushed(self) -> None:
        """vLLM 0.33: every job in flight at the last reset has been flushed."""
        self.side.reset_flushed()

    def shutdown(self) -> None:
        self.side.shutdown()

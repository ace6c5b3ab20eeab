"""The bench's JSON document, schema version 1, as typed records.

``tiered-kv bench --json PATH`` writes one :class:`BenchDocument`; sections that were
not run are absent. Units are in the field names (``gbps`` = 10⁹ bytes per second,
``_ms``, ``_us_per_chunk``, ``ns_per_token``, ``_per_s``); rates and ratios without a
unit are fractions in [0, 1] (``hit_rate``) or plain ratios (``ratio``, ``ttft_speedup``).
:func:`validate` checks a written document against this schema.
"""

from __future__ import annotations

import msgspec

from tiered_kv.bench.tiers import TierFigure


class HitRate(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    trace: str
    capacity_chunks: int
    policy: str
    hit_rate: float


class PolicyOps(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    policy: str
    entries: int
    lookups_per_s: float
    insert_evict_per_s: float
    bytes_per_entry: float


class PolicyFigures(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    hit_rates: list[HitRate]
    ops: list[PolicyOps]


class WorkloadTrace(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    trace: str
    requests: int
    working_set_chunks: int
    cpu_chunks: int
    nvme_chunks: int
    chunk_bytes: int
    chunks_looked_up: int
    #: Fraction of looked-up chunks served from each tier.
    hit_rate_cpu: float
    hit_rate_nvme: float
    tokens_from_cache: int
    prompt_tokens: int
    #: Measured wall time of every load, summed.
    load_s: float
    #: Modelled mean time to first token when every token is recomputed.
    ttft_recompute_ms: float
    #: Mean time to first token with the cache: measured loads + modelled recompute of misses.
    ttft_cached_ms: float
    ttft_speedup: float
    #: Whether the TTFTs include waits behind earlier requests, from the trace's arrival times.
    arrivals: bool = False


class SharingRun(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The two-engine trace served by engines alone, or sharing a remote tier."""

    #: ``alone`` or ``shared``.
    mode: str
    engines: int
    requests: int
    #: Each engine's tiers.
    cpu_chunks: int
    nvme_chunks: int
    chunks_looked_up: int
    #: Fraction of the looked-up chunk positions loaded from some tier.
    hit_rate: float
    #: Of the chunks loads staged (over every KV group), the fraction from each tier.
    staged_from: dict[str, float]
    tokens_from_cache: int
    load_s: float
    ttft_recompute_ms: float
    ttft_cached_ms: float
    ttft_speedup: float


class SharingFigures(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    trace: str
    runs: list[SharingRun]
    #: Hit rate shared minus hit rate alone.
    extra_hit_rate: float


class WorkloadFigures(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: str
    prefill_tokens_per_s: float
    traces: list[WorkloadTrace]
    #: The two-engine trace; ``None`` when no valkey-server was at hand.
    sharing: SharingFigures | None = None


class OverheadFigures(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    requests: int
    chunks_per_request: int
    store_us_per_chunk: float
    load_us_per_chunk: float
    lookup_keys_per_s: float
    #: One ``lookup`` call at a time, as an engine makes them for each waiting request every
    #: step: µs per call for 1 and for 8 resident chunks, a model's namespace and a tenant's.
    lookup_us_per_call_1: float
    lookup_us_per_call_8: float
    tenant_lookup_us_per_call_1: float
    #: A filtered debug event: with logging unconfigured (a fresh interpreter), through
    #: structlog configured as the CLI does (cached), a structlog logger bound once (the
    #: yardstick), and structlog's lazy proxy without caching.
    log_event_us_unconfigured: float
    log_event_us_cached: float
    log_event_us_bound: float
    log_event_us_proxy: float


class KeysCase(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    input: str
    tokens: int
    ns_per_token_best: float
    ns_per_token_median: float
    tokens_per_s_median: float


class KeysFigures(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    block_size: int
    chunk_size: int
    repeats: int
    cases: list[KeysCase]


class ScaleCheck(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One figure of a size against its target: ``value <= target`` when ``at_most``."""

    figure: str
    value: float
    target: float
    at_most: bool
    met: bool
    #: The nvme driver's share or its figure alone, as printed.
    driver: str
    #: For a stall: the bystander's (a loop in another process that only ticks) during the
    #: same growth, as printed; else empty.
    bystander: str


class ScaleSize(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    chunks: int
    stall_max_ms: float
    stall_p99_ms: float
    #: The longest pass of Python's cyclic garbage collector while storing (it holds the loop).
    gc_pause_max_ms: float
    store_chunks_per_s: float
    #: ``TieredKV`` and ``register`` of the store (its warm restart), and the worst stall meanwhile.
    reopen_s: float
    reopen_stall_max_ms: float
    #: The worst stall while the grown manager closed and was let go (its index freed).
    close_stall_max_ms: float
    index_bytes_per_chunk: float
    #: The same growth in a second store, with the host's heap frozen once the manager was
    #: registered (``gc.freeze()``, as vLLM's engine and workers do after start-up): the
    #: stalls, and the longest garbage collection meanwhile.
    frozen_stall_max_ms: float
    frozen_stall_p99_ms: float
    frozen_gc_pause_max_ms: float
    #: The same growth in a third store, its stalls measured by a timer the kernel fires
    #: every 1 ms (``tiered_kv.bench.ticks.KernelTicker``), without the millisecond rounding
    #: of a sleep's wait, and the bystander's meanwhile; ``None`` where the system has no
    #: timerfd (or in a document written before they were measured).
    kernel_stall_max_ms: float | None = None
    kernel_stall_p99_ms: float | None = None
    kernel_bystander_stall_max_ms: float | None = None
    kernel_bystander_stall_p99_ms: float | None = None
    #: A loop in another process that only ticks (``tiered_kv.bench.ticks``), during the
    #: growth and during the frozen growth: the stalls this machine gives any loop under
    #: the same load, which the library's own cannot go below.
    bystander_stall_max_ms: float
    bystander_stall_p99_ms: float
    frozen_bystander_stall_max_ms: float
    frozen_bystander_stall_p99_ms: float
    #: The nvme driver alone growing a store to this size with the same batches.
    driver_stall_max_ms: float
    driver_stall_p99_ms: float
    driver_store_chunks_per_s: float
    #: The nvme driver alone again, paced at the rate ``TieredKV`` stored at this size (at
    #: most ``PACED_CHUNKS`` chunks): the stalls its I/O path alone gives the loop at that
    #: rate, and the rate it kept.
    paced_driver_stall_max_ms: float
    paced_driver_stall_p99_ms: float
    paced_driver_chunks_per_s: float
    #: The nvme driver's ``open`` within the reopen, and its slot map's bytes per chunk.
    driver_reopen_s: float
    driver_bytes_per_chunk: float
    checks: list[ScaleCheck]


class ScaleFigures(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    chunk_bytes: int
    requests: int
    batch_chunks: int
    #: The ticker alone on an idle loop, same run: the machine's own stalls.
    idle_stall_max_ms: float
    idle_stall_p99_ms: float
    sizes: list[ScaleSize]


class BenchError(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    section: str
    error: str


class BenchDocument(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    schema: int
    errors: list[BenchError]
    tiers: list[TierFigure] | None = None
    workload: WorkloadFigures | None = None
    policies: PolicyFigures | None = None
    overhead: OverheadFigures | None = None
    keys: KeysFigures | None = None
    scale: ScaleFigures | None = None


def validate(data: bytes) -> BenchDocument:
    """Decode a bench JSON document; ``msgspec.ValidationError`` names what does not fit."""
    document = msgspec.json.decode(data, type=BenchDocument)
    if document.schema != 1:
        raise msgspec.ValidationError(f"unknown schema version {document.schema}")
    return document

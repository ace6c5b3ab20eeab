"""The vLLM adapter's engine-core side against vLLM's scheduler-side call pattern, without an
engine: lookups repeated every step a request waits, prepare/complete pairs for loads and
stores, stores completing after their request finished, promotions from nvme planned at the
end of a step, a corrupt or slow nvme chunk turning into a miss, store what fits, reset.

The control plane, the cpu tier and the nvme thread are the real ones; the workers are a
stand-in that writes each chunk's bytes into its cpu slot at store and checks them at load, so
that every test also proves that a load never reads another chunk's bytes."""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_namespace

from tiered_kv.config import NamespacePolicyConfig, NvmeTierConfig, WritePolicy
from tiered_kv.control import ControlPlane, Pool
from tiered_kv.errors import TieredKVError, TierIOError
from tiered_kv.integrations.vllm import scheduler_side
from tiered_kv.integrations.vllm.core_plane import CoreDataPlane
from tiered_kv.integrations.vllm.scheduler_side import Answer, RequestState, SchedulerSide, Source
from tiered_kv.integrations.vllm.stats_file import read_statistics
from tiered_kv.registry import TIERS
from tiered_kv.telemetry import Telemetry
from tiered_kv.tiers.nvme import NvmeTier
from tiered_kv.tiers.pinned_cpu import PinnedCpuTier

NAMESPACE = make_namespace()
CHUNK_BYTES = NAMESPACE.geometry.chunk_bytes(0)
GROUP_ID = 3  # vLLM's KV-cache group id of the one offloaded group: not its position


def offload_key(prefix: str, chunk: int) -> bytes:
    """vLLM's OffloadKey of chunk ``chunk`` of prompt ``prefix``: a block hash, then the group id."""
    return hashlib.sha256(f"{prefix}/{chunk}".encode()).digest() + GROUP_ID.to_bytes(4, "big")


def content(key: bytes) -> torch.Tensor:
    """The bytes the stand-in workers store for ``key``."""
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
    return torch.randint(0, 256, (CHUNK_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


class Engine:
    """A SchedulerSide over real tiers, and the workers' part played in-process."""

    def __init__(
        self,
        tmp_path: Path,
        *,
        cpu_chunks: int,
        nvme_chunks: int = 0,
        policy: NamespacePolicyConfig | None = None,
        deadline_s: float = 30.0,
        max_store_chunks: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        **options: Any,
    ) -> None:
        self.cpu = PinnedCpuTier(slot_bytes=CHUNK_BYTES, num_slots=cpu_chunks, pin=False)
        self.telemetry = Telemetry(4096)
        policy = policy or NamespacePolicyConfig()

        def open_pools() -> tuple[ControlPlane, list[Pool]]:
            control = ControlPlane(self.telemetry, max_tenants=8)
            return control, control.add_pools(NAMESPACE, policy, cpu_chunks, nvme_chunks)

        self.core: CoreDataPlane[Any] | None = None
        if nvme_chunks:
            config = NvmeTierConfig(root=str(tmp_path / "nvme"), capacity_bytes=1 << 30, io_depth=2)
            self.core = CoreDataPlane(NAMESPACE, [self.cpu], config, nvme_slots=nvme_chunks)
        self.side = SchedulerSide(
            NAMESPACE,
            open_pools,
            self.telemetry,
            group_ids=[GROUP_ID],
            core=self.core,
            nvme_slots=nvme_chunks,
            promotion_deadline_s=deadline_s,
            max_store_chunks=max_store_chunks,
            clock=clock,
            **options,
        )
        if self.core is not None:
            self.settle(lambda: self.side._nvme_open)

    def settle(self, done: Callable[[], bool], timeout: float = 30) -> None:
        """Step the engine (nothing scheduled) until ``done``, as vLLM keeps stepping."""
        deadline = time.monotonic() + timeout
        while not done():
            self.side.schedule_end()
            assert time.monotonic() < deadline, "the engine core never got there"
            time.sleep(0.002)

    # -- what vLLM's connector does for one request ----------------------------------------
    def scan(self, request: RequestState, keys: list[bytes]) -> tuple[int, bool]:
        """vLLM's prefix scan: (chunks hit, deferred)."""
        hits, deferred = 0, False
        for key in keys:
            answer = self.side.lookup(request, key)
            if answer is Answer.MISS:
                break
            hits += 1
            deferred |= answer is Answer.HIT_PENDING
        return hits, deferred

    def store(self, request: RequestState, keys: list[bytes], *, complete: bool = True) -> list[bytes]:
        """prepare_store, the workers' copies into the slots, complete_store."""
        answer = self.side.prepare_store(request, keys)
        if answer is None:
            return []
        [slots] = answer.slots
        assert len(slots) == len(answer.keys)
        for key, slot in zip(answer.keys, slots, strict=True):
            self.cpu.view(slot).copy_(content(key))
        if complete:
            self.side.complete_store(answer.keys, ok=True)
        return answer.keys

    def load(self, request: RequestState, request_id: str, keys: list[bytes]) -> None:
        """prepare_load, the workers' copies out of the slots (checked), complete_load."""
        [slots] = self.side.prepare_load(request, request_id, keys)
        for key, slot in zip(keys, slots, strict=True):
            assert torch.equal(self.cpu.view(slot), content(key)), "a load would read another chunk's bytes"
        self.side.complete_load(request_id)

    def serve(self, prefix: str, chunks: int, request_id: str, timeout: float = 30) -> int:
        """A request as vLLM runs it: looked up every step until no lookup defers it, then
        the hit prefix loaded, then every chunk it computed stored; the chunks it hit."""
        request = self.side.new_request()
        keys = [offload_key(prefix, c) for c in range(chunks)]
        deadline = time.monotonic() + timeout
        while True:
            hits, deferred = self.scan(request, keys)
            if not deferred:
                break
            self.side.schedule_end()
            assert time.monotonic() < deadline, "a request waited forever"
            time.sleep(0.002)
        if hits:
            self.load(request, request_id, keys[:hits])
        self.side.schedule_end()
        self.store(request, keys[hits:])
        self.side.schedule_end()
        return hits

    def on_nvme(self, chunks: int) -> bool:
        """Whether ``chunks`` chunks are on nvme and no write is in flight (their cpu pins released)."""
        stats = self.side.statistics()
        return stats.queue_depths["nvme_writes"] == 0 and stats.tiers[1].used_chunks == chunks

    def only_on_nvme(self, prefix: str, chunks: int, *, filler: int) -> None:
        """Serve ``prefix`` (written through to nvme), then a filler prompt of ``filler`` chunks
        (``prefix + "-filler"``) that pushes it out of cpu; each time until the writes are done
        (a write pins its cpu chunks, and a pinned chunk cannot make room for a promotion)."""
        start = self.side.statistics().tiers[1].used_chunks
        self.serve(prefix, chunks, f"{prefix}-writer")
        self.settle(lambda: self.on_nvme(start + chunks))
        self.serve(f"{prefix}-filler", filler, f"{prefix}-filler")
        self.settle(lambda: self.on_nvme(start + chunks + filler))

    def close(self) -> None:
        self.side.shutdown()


@pytest.fixture
def engines(tmp_path: Path) -> Any:
    made: list[Engine] = []

    def make(**options: Any) -> Engine:
        engine = Engine(tmp_path, **options)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def test_a_stored_prefix_is_a_hit_and_loads_the_bytes_that_were_stored(engines: Any) -> None:
    engine = engines(cpu_chunks=16)
    assert engine.serve("a", 4, "r1") == 0
    assert engine.serve("a", 6, "r2") == 4  # the first 4 chunks from the connector, 2 computed
    assert engine.serve("a", 6, "r3") == 6
    stats = engine.side.statistics()
    assert stats.loaded_chunks == {"cpu": 10}
    engine.side.control.verify_invariants()


def test_lookups_repeated_every_step_derive_each_key_once_per_request(
    engines: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engines(cpu_chunks=8)
    engine.serve("a", 3, "r1")
    derived = []
    real = scheduler_side.chunk_keys_from_block_hashes
    monkeypatch.setattr(
        scheduler_side, "chunk_keys_from_block_hashes", lambda *a, **k: derived.append(1) or real(*a, **k)
    )
    request = engine.side.new_request()
    keys = [offload_key("a", c) for c in range(3)]
    for _ in range(20):  # a request waiting for GPU blocks is looked up on every step
        assert engine.scan(request, keys) == (3, False)
        engine.side.schedule_end()
    assert len(derived) == 3


def test_a_hit_is_leased_until_the_end_of_the_step_so_a_store_cannot_evict_it(engines: Any) -> None:
    # Given a full cpu tier, and a request whose lookups just hit its oldest chunks
    engine = engines(cpu_chunks=4)
    engine.serve("a", 4, "r1")
    reader = engine.side.new_request()
    keys = [offload_key("a", c) for c in range(2)]
    assert engine.scan(reader, keys) == (2, False)
    # When, in the same step, another request stores 4 chunks (LRU would evict the hits)
    stored = engine.store(engine.side.new_request(), [offload_key("b", c) for c in range(4)])
    # Then only the unleased chunks made room, and the reader's load still finds its bytes
    assert len(stored) == 2
    engine.load(reader, "reader", keys)
    engine.side.control.verify_invariants()


def test_a_chunk_pinned_by_a_load_is_never_evicted_until_complete_load(engines: Any) -> None:
    engine = engines(cpu_chunks=2)
    engine.serve("a", 2, "r1")
    reader = engine.side.new_request()
    keys = [offload_key("a", c) for c in range(2)]
    engine.scan(reader, keys)
    engine.side.prepare_load(reader, "reader", keys)
    engine.side.schedule_end()  # the lease ends; the pins hold
    # Every victim is pinned: nothing fits, and vLLM will offer the chunks again next step
    assert engine.side.prepare_store(engine.side.new_request(), [offload_key("b", 0)]) is None
    assert engine.telemetry.stores_rejected == 1
    engine.side.complete_load("reader")
    assert engine.store(engine.side.new_request(), [offload_key("b", 0)]) == [offload_key("b", 0)]


def test_a_store_larger_than_the_tier_stores_the_prefix_that_fits(engines: Any) -> None:
    engine = engines(cpu_chunks=8)
    keys = [offload_key("a", c) for c in range(16)]
    stored = engine.store(engine.side.new_request(), keys)
    assert stored == keys[:8]
    assert engine.serve("a", 16, "r2") == 8


def test_stores_in_flight_are_bounded_and_refused_beyond_the_bound(engines: Any) -> None:
    engine = engines(cpu_chunks=16, max_store_chunks=4)
    first = engine.store(engine.side.new_request(), [offload_key("a", c) for c in range(3)], complete=False)
    assert len(first) == 3
    assert engine.side.prepare_store(engine.side.new_request(), [offload_key("b", c) for c in range(2)]) is None
    engine.side.complete_store(first, ok=True)
    assert engine.store(engine.side.new_request(), [offload_key("b", c) for c in range(2)])


def test_a_store_that_completes_after_its_request_finished_is_served(engines: Any) -> None:
    engine = engines(cpu_chunks=8)
    writer = engine.side.new_request()
    keys = [offload_key("a", c) for c in range(3)]
    answer = engine.side.prepare_store(writer, keys)
    assert answer is not None
    # vLLM finished the request (on_request_finished) before the workers reported the store
    del writer
    reader = engine.side.new_request()
    assert engine.scan(reader, keys) == (3, True)  # pending: the bytes are not there yet
    for key, slot in zip(answer.keys, answer.slots[0], strict=True):
        engine.cpu.view(slot).copy_(content(key))
    engine.side.complete_store(answer.keys, ok=True)
    assert engine.scan(reader, keys) == (3, False)
    engine.load(reader, "reader", keys)


def test_a_failed_store_leaves_nothing_to_hit(engines: Any) -> None:
    engine = engines(cpu_chunks=8)
    keys = [offload_key("a", c) for c in range(2)]
    answer = engine.side.prepare_store(engine.side.new_request(), keys)
    assert answer is not None
    engine.side.complete_store(answer.keys, ok=False)
    assert engine.scan(engine.side.new_request(), keys) == (0, False)
    engine.side.control.verify_invariants()


def test_prepare_load_of_a_chunk_that_is_not_ready_is_refused_loudly(engines: Any) -> None:
    engine = engines(cpu_chunks=8)
    with pytest.raises(TieredKVError, match="not ready"):
        engine.side.prepare_load(engine.side.new_request(), "r", [offload_key("nope", 0)])
    engine.serve("a", 2, "r1")
    request = engine.side.new_request()
    engine.scan(request, [offload_key("a", 0)])
    engine.side.prepare_load(request, "r2", [offload_key("a", 0)])
    with pytest.raises(TieredKVError, match="already has a load"):
        engine.side.prepare_load(request, "r2", [offload_key("a", 0)])


def test_an_nvme_chunk_is_pending_until_promoted_then_a_hit_from_disk(engines: Any) -> None:
    # Given chunks written through to nvme, then pushed out of a small cpu tier
    engine = engines(cpu_chunks=4, nvme_chunks=32)
    engine.only_on_nvme("a", 4, filler=4)
    # When a request asks for a's prefix
    request = engine.side.new_request()
    keys = [offload_key("a", c) for c in range(4)]
    assert engine.scan(request, keys) == (4, True)  # deferred: wanted from nvme
    assert engine.side.has_pending_work()
    engine.settle(lambda: engine.scan(request, keys) == (4, False))
    # Then the chunks came from disk, verified, into cpu, and load back the stored bytes
    assert [engine.side.load_source(request, k) for k in keys] == [Source.DISK] * 4
    engine.load(request, "r3", keys)
    assert engine.side.statistics().loaded_chunks == {"nvme": 4}
    assert not engine.side.has_pending_work()


def corrupt_nvme_slot(tmp_path: Path, slot: int) -> None:
    from tiered_kv.tiers.nvme_format import HEADER_BYTES, slot_stride

    [slots] = (tmp_path / "nvme").glob("*/g0.slots")
    with slots.open("r+b") as f:
        f.seek(slot * slot_stride(CHUNK_BYTES) + HEADER_BYTES + 7)
        byte = f.read(1)[0]
        f.seek(slot * slot_stride(CHUNK_BYTES) + HEADER_BYTES + 7)
        f.write(bytes([byte ^ 1]))


def test_a_corrupt_nvme_chunk_becomes_a_miss_never_a_load(engines: Any, tmp_path: Path) -> None:
    engine = engines(cpu_chunks=4, nvme_chunks=32)
    engine.only_on_nvme("a", 3, filler=4)
    corrupt_nvme_slot(tmp_path, 1)  # a's second chunk
    # The request waits for the promotions, then hits only the chunk before the corrupt one
    assert engine.serve("a", 3, "r3") == 1
    assert engine.side.statistics().drivers[0].errors == 1
    # The corrupt copy is gone from nvme; the recomputed chunks were stored again
    assert engine.serve("a", 3, "r4") == 3


def test_a_promotion_past_its_deadline_is_a_miss_for_the_request(engines: Any, tmp_path: Path) -> None:
    release = threading.Event()

    class StuckNvme(NvmeTier):
        def _read_one(self, op: Any, data: memoryview) -> None:
            release.wait(30)
            super()._read_one(op, data)

    now = [0.0]
    TIERS.register("nvme", StuckNvme)
    try:
        engine = engines(cpu_chunks=4, nvme_chunks=32, deadline_s=5.0, clock=lambda: now[0])
        engine.only_on_nvme("a", 2, filler=4)
        request = engine.side.new_request()
        keys = [offload_key("a", c) for c in range(2)]
        assert engine.scan(request, keys) == (2, True)
        engine.side.schedule_end()  # the promotions start, and hang
        assert engine.scan(request, keys) == (2, True)
        now[0] += 6.0  # past the deadline: the request stops waiting and recomputes
        assert engine.scan(request, keys) == (0, False)
        release.set()
    finally:
        release.set()
        TIERS.unregister("nvme")


def test_a_request_waiting_for_a_promotion_step_after_step_is_remembered_once(engines: Any) -> None:
    # White box: vLLM looks a waiting request up every step (and may repeat a key within one);
    # what a promotion remembers of its waiters must not grow with the steps.
    release = threading.Event()

    class StuckNvme(NvmeTier):
        def _read_one(self, op: Any, data: memoryview) -> None:
            release.wait(30)
            super()._read_one(op, data)

    TIERS.register("nvme", StuckNvme)
    try:
        engine = engines(cpu_chunks=4, nvme_chunks=32)
        engine.only_on_nvme("a", 1, filler=4)
        request = engine.side.new_request()
        keys = [offload_key("a", 0)]
        for _ in range(3):
            engine.scan(request, keys)
        assert [len(w.requests) for w in engine.side._wanted.values()] == [1]
        for _ in range(50):
            engine.side.schedule_end()
            assert engine.scan(request, keys) == (1, True)
        assert [len(p.requests) for p in engine.side._promoting.values()] == [1]
        release.set()
        engine.settle(lambda: engine.scan(request, keys) == (1, False))
    finally:
        release.set()
        TIERS.unregister("nvme")


def test_a_promotion_that_fails_is_a_miss_for_the_request_not_a_retry_forever(engines: Any) -> None:
    class FailingNvme(NvmeTier):
        def _read_one(self, op: Any, data: memoryview) -> None:
            raise TierIOError("reading: injected", tier="nvme")

    TIERS.register("nvme", FailingNvme)
    try:
        engine = engines(cpu_chunks=4, nvme_chunks=32)
        engine.only_on_nvme("a", 2, filler=4)
        # The nvme copy stays (the next read may work) but this request stops waiting for it
        assert engine.serve("a", 2, "r3") == 0
        assert engine.side.statistics().tiers[1].used_chunks == 6
    finally:
        TIERS.unregister("nvme")


def test_a_promotion_with_no_cpu_room_is_a_miss_not_a_wait(engines: Any) -> None:
    engine = engines(cpu_chunks=2, nvme_chunks=32)
    engine.only_on_nvme("a", 2, filler=2)
    pinner = engine.side.new_request()
    filler = [offload_key("a-filler", c) for c in range(2)]
    engine.scan(pinner, filler)
    engine.side.prepare_load(pinner, "pinner", filler)  # every cpu slot pinned by a load
    request = engine.side.new_request()
    keys = [offload_key("a", c) for c in range(2)]
    assert engine.scan(request, keys) == (2, True)
    engine.side.schedule_end()  # no room: the promotion is not planned
    assert engine.scan(request, keys) == (0, False)


def test_reset_drops_every_chunk_and_ignores_completions_of_before(engines: Any, tmp_path: Path) -> None:
    engine = engines(cpu_chunks=8, nvme_chunks=32)
    engine.serve("a", 3, "r1")
    engine.settle(lambda: engine.on_nvme(3))
    in_flight = engine.side.prepare_store(engine.side.new_request(), [offload_key("b", 0)])
    reader = engine.side.new_request()
    engine.scan(reader, [offload_key("a", 0)])
    engine.side.prepare_load(reader, "reader", [offload_key("a", 0)])
    engine.side.reset()
    assert engine.scan(engine.side.new_request(), [offload_key("a", 0)]) == (0, False)
    assert in_flight is not None
    engine.side.complete_store(in_flight.keys, ok=True)  # of the old generation: ignored
    engine.side.complete_load("reader")
    assert engine.scan(engine.side.new_request(), [offload_key("b", 0)]) == (0, False)
    engine.side.control.verify_invariants()
    assert engine.serve("c", 2, "r2") == 0 and engine.serve("c", 2, "r3") == 2
    engine.settle(lambda: engine.on_nvme(2))
    engine.close()
    # nvme forgot the old generation: a restart finds only what was stored after the reset
    again = engines(cpu_chunks=8, nvme_chunks=32)
    assert again.serve("a", 3, "x1") == 0
    assert again.serve("c", 2, "x2") == 2


def test_with_vllms_reset_fence_stores_wait_for_the_flush(engines: Any) -> None:
    engine = engines(cpu_chunks=8, reset_fence=True)
    engine.side.reset()
    assert engine.side.prepare_store(engine.side.new_request(), [offload_key("a", 0)]) is None
    engine.side.reset_flushed()
    assert engine.store(engine.side.new_request(), [offload_key("a", 0)])


def test_a_warm_restart_serves_the_chunks_of_the_previous_engine(engines: Any) -> None:
    engine = engines(cpu_chunks=8, nvme_chunks=32)
    engine.serve("a", 4, "r1")
    engine.settle(lambda: engine.on_nvme(4))
    engine.close()
    again = engines(cpu_chunks=8, nvme_chunks=32)
    assert again.side.statistics().tiers[1].used_chunks == 4
    assert again.serve("a", 4, "r2") == 4
    assert again.side.statistics().loaded_chunks == {"nvme": 4}


def test_selective_writes_a_chunk_to_nvme_once_it_has_been_hit_enough(engines: Any) -> None:
    policy = NamespacePolicyConfig(write_policy=WritePolicy.SELECTIVE, selective_hits=2)
    engine = engines(cpu_chunks=8, nvme_chunks=32, policy=policy)
    engine.serve("a", 2, "r1")
    nvme_used = lambda: engine.side.statistics().tiers[1].used_chunks  # noqa: E731
    engine.serve("a", 2, "r2")
    engine.side.schedule_end()
    assert nvme_used() == 0
    engine.serve("a", 2, "r3")
    engine.settle(lambda: nvme_used() == 2)


def test_a_tenant_has_its_own_share_and_never_reads_another_tenants_chunks(engines: Any) -> None:
    engine = engines(cpu_chunks=8)
    acme = engine.side.new_request("acme")
    keys = [offload_key("a", c) for c in range(2)]
    engine.store(acme, keys)
    assert engine.scan(engine.side.new_request("acme"), keys) == (2, False)
    assert engine.scan(engine.side.new_request("globex"), keys) == (0, False)
    assert engine.scan(engine.side.new_request(), keys) == (0, False)
    shares = {(u.namespace, u.tier): u.used_chunks for u in engine.side.statistics().namespaces}
    assert shares[(acme.fingerprint, "cpu")] == 2


def test_kv_events_name_vllms_keys_of_chunks_stored_and_evicted(engines: Any) -> None:
    engine = engines(cpu_chunks=2, track_keys=True)
    engine.store(engine.side.new_request(), [offload_key("a", 0), offload_key("a", 1)])
    runs = engine.side.take_events()
    assert [(r.tier, r.removed, r.keys) for r in runs] == [("cpu", False, [offload_key("a", 0), offload_key("a", 1)])]
    answer = engine.side.prepare_store(engine.side.new_request(), [offload_key("b", 0)])
    # Prefix-aware eviction: a0 continues into a1, so the leaf a1 goes first.
    assert answer is not None and answer.evicted == [offload_key("a", 1)]
    engine.side.complete_store(answer.keys, ok=True)
    runs = engine.side.take_events()
    assert [(r.tier, r.removed, r.keys) for r in runs] == [
        ("cpu", True, [offload_key("a", 1)]),
        ("cpu", False, [offload_key("b", 0)]),
    ]


def test_the_statistics_file_is_rewritten_as_the_engine_steps_and_at_shutdown(engines: Any, tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    now = [0.0]
    engine = engines(cpu_chunks=8, statistics_path=str(path), statistics_interval_s=10.0, clock=lambda: now[0])
    engine.serve("a", 2, "r1")
    assert not path.exists()
    now[0] += 11
    engine.side.schedule_end()
    first = read_statistics(path)
    assert not first.final and first.statistics.tiers[0].used_chunks == 2
    engine.serve("a", 2, "r2")
    engine.close()
    last = read_statistics(path)
    assert last.final and last.statistics.loaded_chunks == {"cpu": 2}
    assert last.namespace == NAMESPACE.fingerprint_hex


@pytest.mark.parametrize("seed", range(6))
def test_random_requests_as_vllm_schedules_them_never_load_wrong_bytes(engines: Any, seed: int) -> None:
    # Requests over a few shared prefixes, a small cpu tier and nvme; each step some requests
    # are looked up (again), loads and stores are prepared and completed a few steps later
    # in any order, requests finish with stores in flight, resets happen: the indexes stay
    # consistent and every load reads exactly the bytes stored for its keys.
    rng = random.Random(seed)
    engine = engines(cpu_chunks=6, nvme_chunks=24, deadline_s=30.0)
    waiting: list[tuple[str, RequestState, list[bytes]]] = []
    loads: list[tuple[int, str, RequestState, list[bytes]]] = []
    stores: list[tuple[int, list[bytes]]] = []
    step = 0
    for n in range(120):
        step += 1
        if rng.random() < 0.5:
            prefix, chunks = rng.choice("abcd"), rng.randint(1, 5)
            waiting.append((f"q{n}", engine.side.new_request(), [offload_key(prefix, c) for c in range(chunks)]))
        for entry in list(waiting):
            request_id, request, keys = entry
            hits, deferred = engine.scan(request, keys)
            if deferred or rng.random() < 0.2:  # deferred, or no GPU blocks this step
                continue
            waiting.remove(entry)
            if hits:
                [slots] = engine.side.prepare_load(request, request_id, keys[:hits])
                for key, slot in zip(keys[:hits], slots, strict=True):
                    assert torch.equal(engine.cpu.view(slot), content(key))
                loads.append((step + rng.randint(0, 2), request_id, request, keys[:hits]))
            answer = engine.side.prepare_store(request, keys[hits:])
            if answer is not None and answer.keys:
                for key, slot in zip(answer.keys, answer.slots[0], strict=True):
                    engine.cpu.view(slot).copy_(content(key))
                stores.append((step + rng.randint(0, 3), answer.keys))
        for done in [entry for entry in loads if entry[0] <= step]:
            loads.remove(done)
            engine.side.complete_load(done[1])
        rng.shuffle(stores)
        for done in [entry for entry in stores if entry[0] <= step]:
            stores.remove(done)
            engine.side.complete_store(done[1], ok=rng.random() < 0.95)
        if rng.random() < 0.03:
            for _, request_id, _, _ in loads:
                engine.side.complete_load(request_id)
            loads.clear()
            stores.clear()  # vLLM flushes them; their completions are of the old generation
            engine.side.reset()
        engine.side.schedule_end()
        engine.side.control.verify_invariants()
        time.sleep(0.001)
    loaded = engine.side.statistics().loaded_chunks
    assert loaded.get("cpu", 0) and loaded.get("nvme", 0), loaded  # both paths were taken

"""The vLLM adapter's shared cpu slab: layout, creation by the workers, the geometry handshake
the engine core reads, and the file's name gone once the engine core has mapped it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from conftest import make_namespace

from tiered_kv.errors import ConfigError
from tiered_kv.integrations.vllm.slab import ALIGN, RankRecord, Slab, plan_layout, slab_path


def record(rank: int, layout: object, **namespace: object) -> RankRecord:
    return RankRecord(rank=rank, pid=1000 + rank, namespace=make_namespace(**namespace), layout=layout, engine={})  # type: ignore[arg-type]


def test_the_layout_puts_every_group_and_slot_on_a_page_after_one_header_page_per_rank() -> None:
    layout = plan_layout([5000, 9000], world_size=2, capacity_bytes=100 * ALIGN)
    assert layout.header_bytes == 2 * ALIGN
    first, second = layout.groups
    assert (first.rank_bytes, first.slot_bytes, first.slot_stride) == (5000, 10000, 3 * ALIGN)
    assert (second.rank_bytes, second.slot_bytes, second.slot_stride) == (9000, 18000, 5 * ALIGN)
    # As many slots per group as the capacity holds chunks of every group.
    assert layout.num_slots == 100 // 8
    assert first.offset == 2 * ALIGN
    assert second.offset == first.offset + first.slot_stride * layout.num_slots
    assert layout.total_bytes == second.offset + second.slot_stride * layout.num_slots


def test_a_capacity_below_one_chunk_of_every_group_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="cannot hold one chunk") as err:
        plan_layout([3 * ALIGN], world_size=2, capacity_bytes=5 * ALIGN)
    assert err.value.field == "tiered_kv.cpu.capacity_bytes"


def test_workers_create_the_slab_and_the_engine_core_reads_their_records(tmp_path: Path) -> None:
    # Given the two workers of a TP=2 engine, joining the slab at once
    layout = plan_layout([ALIGN], world_size=2, capacity_bytes=8 * ALIGN)
    path = slab_path(tmp_path, "engine/1")
    slabs: dict[int, Slab] = {}

    def worker(rank: int) -> None:
        slabs[rank] = Slab.join(path, layout, timeout_s=10)
        slabs[rank].write_record(record(rank, layout))

    threads = [threading.Thread(target=worker, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # When the engine core attaches
    core, records = Slab.attach(path, world_size=2, timeout_s=10)
    # Then it reads every rank's record and the layout, and the name is gone
    assert [r.rank for r in records] == [0, 1]
    assert core.layout == layout
    assert not path.exists()
    # And all three mappings are one memory: a worker's bytes are the core's
    slabs[1].region(0)[ALIGN : 2 * ALIGN].fill_(7)
    assert torch.all(core.region(0)[ALIGN : 2 * ALIGN] == 7)
    assert core.region(0).data_ptr() % ALIGN == 0
    assert path.name == "tiered-kv-engine_1"


def test_the_handshake_works_across_processes(tmp_path: Path) -> None:
    # Given a worker in a process of its own that creates the slab, writes its record and a slot
    layout = plan_layout([2 * ALIGN], world_size=1, capacity_bytes=4 * ALIGN)
    path = slab_path(tmp_path, "engine")
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pathlib import Path
        from conftest import make_namespace
        from tiered_kv.integrations.vllm.slab import RankRecord, SlabLayout, Slab
        import msgspec
        layout = msgspec.json.decode({__import__("msgspec").json.encode(layout).decode()!r}, type=SlabLayout)
        slab = Slab.join(Path({str(path)!r}), layout, timeout_s=10)
        slab.region(0)[:8] = 42
        slab.write_record(RankRecord(rank=0, pid=0, namespace=make_namespace(), layout=layout, engine={{"v": "1"}}))
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    # When the engine core attaches after the worker exited
    core, [rank0] = Slab.attach(path, world_size=1, timeout_s=10)
    # Then the record and the bytes are there
    assert rank0.engine == {"v": "1"} and rank0.namespace == make_namespace()
    assert core.region(0)[:8].tolist() == [42] * 8


def test_ranks_that_disagree_on_the_layout_or_the_namespace_stop_the_engine(tmp_path: Path) -> None:
    layout = plan_layout([ALIGN], world_size=2, capacity_bytes=8 * ALIGN)
    other = plan_layout([ALIGN], world_size=2, capacity_bytes=6 * ALIGN)
    path = slab_path(tmp_path, "a")
    slab = Slab.join(path, layout, timeout_s=1)
    slab.write_record(record(0, layout))
    slab.write_record(record(1, other))
    with pytest.raises(ConfigError, match="laid out the cpu slab differently"):
        Slab.attach(path, world_size=2, timeout_s=1)
    path = slab_path(tmp_path, "b")
    slab = Slab.join(path, layout, timeout_s=1)
    slab.write_record(record(0, layout))
    slab.write_record(record(1, layout, model_revision="r2"))
    with pytest.raises(ConfigError, match="different KV caches"):
        Slab.attach(path, world_size=2, timeout_s=1)


def test_a_missing_or_torn_record_is_a_config_error_naming_the_rank(tmp_path: Path) -> None:
    layout = plan_layout([ALIGN], world_size=2, capacity_bytes=8 * ALIGN)
    path = slab_path(tmp_path, "e")
    slab = Slab.join(path, layout, timeout_s=1)
    slab.write_record(record(0, layout))
    slab.write_record(record(1, layout))
    slab.region(0)  # the slots are not the header
    raw = torch.frombuffer(slab._mapping, dtype=torch.uint8)  # a torn payload: the checksum no longer matches
    raw[ALIGN + 20] ^= 0xFF
    assert slab.read_record(1) is None
    with pytest.raises(ConfigError, match=r"ranks \[1\] wrote no record") as err:
        Slab.attach(path, world_size=2, timeout_s=0.05)
    assert err.value.field == "startup_timeout_s"


def test_no_slab_at_all_says_that_the_workers_must_register_first(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no worker created the cpu slab"):
        Slab.attach(slab_path(tmp_path, "none"), world_size=1, timeout_s=0.05)


def test_a_stale_smaller_file_of_the_same_engine_id_is_named_not_mapped(tmp_path: Path) -> None:
    layout = plan_layout([ALIGN], world_size=1, capacity_bytes=8 * ALIGN)
    path = slab_path(tmp_path, "stale")
    path.write_bytes(bytes(ALIGN))
    with pytest.raises(ConfigError, match="stale file"):
        Slab.join(path, layout, timeout_s=0.05)


def test_a_record_larger_than_its_page_is_refused(tmp_path: Path) -> None:
    layout = plan_layout([ALIGN], world_size=1, capacity_bytes=8 * ALIGN)
    slab = Slab.join(slab_path(tmp_path, "big"), layout, timeout_s=1)
    with pytest.raises(ConfigError, match="more than a page"):
        slab.write_record(record(0, layout, model_id="m" * ALIGN))

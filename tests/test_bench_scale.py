"""``tiered-kv bench scale`` at its smallest size: every figure, its target and whether it
is met, in the table and in the JSON document."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest

from tiered_kv.bench import scale
from tiered_kv.bench.schema import validate
from tiered_kv.cli import main
from tiered_kv.keys import KEY_BYTES

FIGURES = [
    "max stall (ms)",
    "p99 stall (ms)",
    "max stall, heap frozen (ms)",
    "p99 stall, heap frozen (ms)",
    "max stall, kernel-timed ticks (ms)",
    "p99 stall, kernel-timed ticks (ms)",
    "chunks/s stored",
    "reopen (s)",
    "index B/chunk",
]


def test_bench_scale_reports_each_figure_against_its_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    code = main(["bench", "scale", "--max-chunks", "10000", "--nvme-dir", str(tmp_path), "--json", str(out)])
    assert code == 0
    assert gc.get_freeze_count() == 0, "the heap the frozen pass froze is thawed again"
    table = capsys.readouterr().out
    assert "scale: nvme tier of 4,096 B chunks through TieredKV" in table
    assert all(figure in table for figure in FIGURES)
    document = validate(out.read_bytes())
    assert document.errors == [] and document.scale is not None
    [size] = document.scale.sizes
    assert 10_000 <= size.chunks < 10_000 + 8 * 32, "grown to the size, in whole rounds of stores"
    assert [check.figure for check in size.checks] == FIGURES
    for check in size.checks:
        assert check.met == (check.value <= check.target if check.at_most else check.value >= check.target)
    assert size.store_chunks_per_s > 0 and size.driver_store_chunks_per_s > 0
    # The driver alone paced at TieredKV's rate: a sleep never wakes early, so it cannot
    # have gone faster than asked (but for the first call of each request).
    assert 0 < size.paced_driver_chunks_per_s <= 1.1 * size.store_chunks_per_s
    assert size.paced_driver_stall_max_ms >= size.paced_driver_stall_p99_ms >= 0
    stalls = {check.figure: check.driver for check in size.checks}
    assert (
        stalls["p99 stall (ms)"] == f"{size.driver_stall_p99_ms:.2f}; {size.paced_driver_stall_p99_ms:.2f} at its rate"
    )
    assert "paced at the rate TieredKV stored" in table
    assert 0 < size.driver_reopen_s <= size.reopen_s
    assert size.driver_bytes_per_chunk == pytest.approx(17 * 10_000 / size.chunks)
    assert size.index_bytes_per_chunk > size.driver_bytes_per_chunk
    assert size.frozen_stall_max_ms >= size.frozen_stall_p99_ms >= 0 and size.frozen_gc_pause_max_ms >= 0
    assert size.close_stall_max_ms >= 0 and size.reopen_stall_max_ms >= 0
    assert size.bystander_stall_max_ms >= size.bystander_stall_p99_ms >= 0
    assert size.frozen_bystander_stall_max_ms >= size.frozen_bystander_stall_p99_ms >= 0
    bystanders = [
        size.bystander_stall_max_ms,
        size.bystander_stall_p99_ms,
        size.frozen_bystander_stall_max_ms,
        size.frozen_bystander_stall_p99_ms,
    ]
    assert size.kernel_stall_max_ms is not None and size.kernel_stall_p99_ms is not None, "Linux has a timerfd"
    assert size.kernel_bystander_stall_max_ms is not None and size.kernel_bystander_stall_p99_ms is not None
    assert size.kernel_stall_max_ms >= size.kernel_stall_p99_ms >= 0
    bystanders += [size.kernel_bystander_stall_max_ms, size.kernel_bystander_stall_p99_ms]
    assert [check.bystander for check in size.checks] == [f"{v:.2f}" for v in bystanders] + [""] * 3
    assert "kernel-timed ticks: how late the loop runs a 1 ms timerfd's callback" in table
    assert "other process" in table
    for store in ("frozen", "kernel"):
        assert not list(tmp_path.glob(f"*/{store}")), f"the {store} store is removed"
    assert json.loads(out.read_text())["scale"]["sizes"][0]["checks"][0]["figure"] == FIGURES[0]


def test_bench_scale_refuses_a_size_below_its_smallest(tmp_path: Path) -> None:
    assert main(["bench", "scale", "--max-chunks", "5000", "--nvme-dir", str(tmp_path)]) == 2


def test_bench_scale_leaves_a_heap_the_caller_froze_frozen(tmp_path: Path) -> None:
    gc.freeze()
    try:
        assert main(["bench", "scale", "--max-chunks", "10000", "--nvme-dir", str(tmp_path)]) == 0
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_the_bench_draws_a_stores_keys_without_asking_the_os(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: keys came in blocks of 65,536 drawn from the OS (``os.urandom``), which
    held the loop 2.4 ms each, every 65,536 chunks, in the stalls measured as the
    library's. A store's keys now cost the loop a draw of its own size."""
    keys = scale._Keys()

    def asked(n: int) -> bytes:
        raise AssertionError(f"os.urandom({n}) on the loop")

    monkeypatch.setattr(scale.os, "urandom", asked)
    taken = [key for _ in range(4096) for key in keys.take(scale.BATCH)]
    assert len(taken) == 4096 * scale.BATCH and all(len(key) == KEY_BYTES for key in taken)
    assert len(set(taken)) == len(taken)

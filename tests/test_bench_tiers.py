"""``tiered-kv bench tiers`` at small sizes: the table and the JSON the issue specifies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiered_kv.bench.probe import filesystem
from tiered_kv.cli import main
from tiered_kv.testing.valkey_server import missing as valkey_missing


def test_bench_tiers_reports_each_path_against_its_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    args = ["bench", "tiers", "--model", "llama-1b", "--chunk-mib", "1", "--tier-mem-mib", "4", "--tier-disk-mib", "8"]
    args += ["--tier-remote-mib", "4"]
    code = main([*args, "--tier-repeats", "1", "--io-depth", "2", "--nvme-dir", str(tmp_path), "--json", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "tiers: driver throughput" in table and f"disk files in {tmp_path} (" in table
    document = json.loads(out.read_text())
    assert document["schema"] == 1 and document["errors"] == []
    figures = document["tiers"]
    paths = [(f["path"], f.get("layout")) for f in figures]
    assert sorted(paths, key=str) == sorted(
        [
            ("gpu->cpu", "per-layer"),
            ("gpu->cpu", "per-layer, scattered"),
            ("gpu->cpu", "fused"),
            ("cpu->gpu", "per-layer"),
            ("cpu->gpu", "per-layer, scattered"),
            ("cpu->gpu", "fused"),
            ("cpu->nvme", None),
            ("nvme->cpu", None),
            ("cpu->gpu via manager", None),
            ("nvme->gpu via manager", None),
            *([("cpu->remote", None), ("remote->cpu", None)] if valkey_missing() is None else []),
        ],
        key=str,
    )
    for figure in figures:
        assert figure["chunk_bytes"] == 1 << 20
        assert figure["gbps"] > 0 and figure["limit_gbps"] > 0 and figure["limit"]
        # Each figure is reported rounded (the ratio to three places: at 0.0235, 2% off).
        assert figure["ratio"] == pytest.approx(figure["gbps"] / figure["limit_gbps"], rel=0.01, abs=5e-4)
    assert list(tmp_path.iterdir()) == [out], "the bench leaves no disk files behind"


def test_a_chunk_size_that_is_not_a_number_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "tiers", "--chunk-mib", "two"])
    assert "expected MiB sizes" in capsys.readouterr().err


def test_the_filesystem_of_a_path_comes_from_the_mount_table() -> None:
    assert filesystem(Path("/proc/self")) == "proc"
    assert filesystem(Path("/")) not in ("", "unknown")

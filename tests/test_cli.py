"""The ``tiered-kv`` CLI end to end at small sizes."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tiered_kv.bench import SectionResult, add_bench_parser
from tiered_kv.bench.keys import KeysSection
from tiered_kv.bench.report import Progress
from tiered_kv.bench.schema import validate
from tiered_kv.cli import main


def test_bench_keys_prints_a_table_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    code = main(["bench", "keys", "--key-tokens", "4096", "--key-repeats", "2", "--json", str(out)])
    assert code == 0
    stdout = capsys.readouterr().out
    assert "keys: SHA-256 chunk keys" in stdout and "4,096" in stdout
    document = json.loads(out.read_text())
    assert document["schema"] == 1 and document["errors"] == []
    cases = {case["input"]: case for case in document["keys"]["cases"]}
    assert set(cases) == {"token ids (list)", "token ids (numpy)", "engine block hashes"}
    for case in cases.values():
        assert case["tokens"] == 4096
        assert 0 < case["ns_per_token_best"] <= case["ns_per_token_median"]
        assert case["tokens_per_s_median"] == pytest.approx(1e9 / case["ns_per_token_median"])


class BrokenSection:
    name = "broken"
    summary = "always fails"

    def add_arguments(self, parser: argparse._ArgumentGroup) -> None:
        pass

    def run(self, args: argparse.Namespace, progress: Progress) -> SectionResult:
        raise RuntimeError("disk vanished")


def test_a_failing_section_gives_a_nonzero_exit_and_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"), sections=lambda: [BrokenSection(), KeysSection()])
    out = tmp_path / "bench.json"
    args = parser.parse_args(["bench", "--key-tokens", "256", "--key-repeats", "1", "--json", str(out)])
    assert args.handler(args) == 1
    captured = capsys.readouterr()
    assert "bench section 'broken' failed: RuntimeError: disk vanished" in captured.err
    document = json.loads(out.read_text())
    assert document["errors"] == [{"section": "broken", "error": "RuntimeError: disk vanished"}]
    assert "keys" in document  # the other sections still report


def test_console_script_runs(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tiered_kv.cli", "bench", "keys", "--key-tokens", "512", "--key-repeats", "1"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "ns/token" in result.stdout


def test_unknown_section_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["bench", "nope"])
    assert caught.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


SMALL = [
    "--chunk-mib", "1",
    "--tier-mem-mib", "4",
    "--tier-disk-mib", "4",
    "--tier-repeats", "1",
    "--workload-requests", "6",
    "--policy-entries", "2000",
    "--policy-lookups", "2000",
    "--policy-cycles", "2000",
    "--policy-repeats", "1",
    "--policy-trace-scale", "0.01",
    "--overhead-requests", "20",
    "--key-tokens", "1024",
    "--key-repeats", "1",
    "--max-chunks", "10000",
]  # fmt: skip


def test_bare_bench_runs_every_section_and_its_json_matches_the_schema(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    code = main(["bench", *SMALL, "--nvme-dir", str(tmp_path), "--json", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0
    document = validate(out.read_bytes())
    assert document.errors == []
    assert document.tiers and {f.path for f in document.tiers} >= {"gpu->cpu", "cpu->gpu", "cpu->nvme", "nvme->cpu"}
    assert all(
        f.gbps > 0 and f.limit_gbps > 0 and f.ratio == pytest.approx(f.gbps / f.limit_gbps, rel=0.01, abs=0.005)
        for f in document.tiers
    )
    assert document.workload and [t.trace for t in document.workload.traces] == ["chat", "rag", "scan_polluted"]
    for trace in document.workload.traces:
        assert 0 <= trace.hit_rate_cpu + trace.hit_rate_nvme <= 1
        assert trace.tokens_from_cache <= trace.prompt_tokens
    assert document.policies and document.policies.ops and document.policies.hit_rates
    assert document.overhead and document.overhead.store_us_per_chunk > 0
    assert document.keys and document.keys.cases
    for title in ("tiers", "workload", "overhead", "keys"):
        assert title in stdout


def test_plot_draws_a_png_of_the_tiers_and_workload(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    args = ["bench", "workload", "--workload-requests", "4", "--nvme-dir", str(tmp_path), "--plot", str(png)]
    assert main(args) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plot_of_sections_it_cannot_draw_is_a_failed_step(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "keys", "--key-tokens", "256", "--plot", str(tmp_path / "x.png"), "--json", str(out)]) == 1
    assert json.loads(out.read_text())["errors"][0]["section"] == "plot"


@pytest.mark.parametrize("model", ["gemma-swa", "deepseek-mla"])
def test_workload_replays_hybrid_and_mla_presets(tmp_path: Path, model: str) -> None:
    out = tmp_path / "bench.json"
    args = ["bench", "workload", "--model", model, "--workload-requests", "4", "--nvme-dir", str(tmp_path)]
    assert main([*args, "--json", str(out)]) == 0
    document = validate(out.read_bytes())
    assert document.workload is not None and document.workload.model != "meta-llama/Llama-3.2-1B"
    for trace in document.workload.traces:
        assert 0 <= trace.hit_rate_cpu + trace.hit_rate_nvme <= 1

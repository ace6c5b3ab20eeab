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

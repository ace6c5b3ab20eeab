"""``tiered-kv plan``: on a synthetic trace of the bench, on its exported file, on bad files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_with_output_closed

from tiered_kv.cli import EXIT_OUTPUT_CLOSED, main

SMALL = ["--scale", "0.02", "--points", "4", "--smallest", "16", "--policies", "lru,s3fifo"]


def test_plan_on_a_synthetic_trace_prints_curves_sizes_and_writes_json_plot_and_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png, exported = tmp_path / "plan.json", tmp_path / "plan.png", tmp_path / "rag.jsonl"
    args = ["plan", "--synthetic", "rag", *SMALL, "--json", str(out), "--plot", str(png), "--export", str(exported)]
    assert main(args) == 0
    stdout = capsys.readouterr().out
    assert "plan: rag" in stdout and "best tiered-kv policy against the best peer and MIN" in stdout
    assert ("nvme:" in stdout and "GiB" in stdout) or "MiB" in stdout
    plan = json.loads(out.read_text())
    names = [curve["name"] for curve in plan["curves"]]
    assert names[-4:] == ["lru-plain", "vllm-lru", "vllm-arc", "min"]
    assert {"lru", "lru+seen_k", "lru+seen_adaptive", "s3fifo+seen_k"} <= set(names)
    assert plan["capacities"][-1] == plan["working_set_chunks"] and len(plan["capacities"]) == 4
    assert {sizing["tier"] for sizing in plan["sizings"]} == {"cpu", "nvme"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The exported trace, read as a file, plans the same.
    again = tmp_path / "again.json"
    file_args = ["plan", "--trace", str(exported), "--trace-block-tokens", "256", *SMALL[2:], "--json", str(again)]
    assert main(file_args) == 0
    replanned = json.loads(again.read_text())
    assert replanned["curves"] == plan["curves"] and replanned["trace"] == "rag.jsonl"


def test_plan_reports_bad_lines_with_their_numbers_and_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    good = [f'{{"timestamp": {i}, "input_length": 1024, "hash_ids": [0, {i}]}}' for i in range(1, 9)]
    trace.write_text("\n".join([*good[:4], "{oops", *good[4:]]) + "\n")
    assert main(["plan", "--trace", str(trace), "--chunk-tokens", "512", "--capacities", "1,4"]) == 0
    captured = capsys.readouterr()
    assert "t.jsonl: skipped 1 bad lines (line 5: " in captured.err
    assert "8 requests" in captured.out


def test_plan_on_a_file_that_is_not_a_trace_is_one_line_and_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "notes.txt"
    trace.write_text("hello\nworld\n")
    assert main(["plan", "--trace", str(trace)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tiered-kv plan: notes.txt is not a Mooncake-format trace") and "\n" not in err


@pytest.mark.parametrize("option", ["--trace-block-tokens", "--chunk-tokens"])
def test_plan_refuses_blocks_and_chunks_too_large_to_key(option: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Regression: a block of 2**33 tokens broke the keys' struct: exit 1, ``error: error: 'I' format ...``."""
    with pytest.raises(SystemExit) as exit_status:
        main(["plan", "--synthetic", "chat", option, "8589934592"])
    assert exit_status.value.code == 2
    assert f"argument {option}: must be at most 1,048,576, got '8589934592'" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [["--capacities", "0,5"], ["--target-hit-rate", "1.5"], ["--synthetic", "nope"]])
def test_plan_rejects_bad_options(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", *(["--synthetic", "chat"] if "--synthetic" not in bad else []), *bad])


@pytest.mark.parametrize("option", [["--export", "out.jsonl"], ["--seed", "3"], ["--scale", "2"]])
def test_options_of_a_synthetic_trace_given_with_a_trace_file_are_refused(
    option: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: ``plan --trace F --export x.jsonl`` exited 0 and wrote nothing."""
    monkeypatch.chdir(tmp_path)
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}\n')
    assert main(["plan", "--trace", str(trace), *option]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and option[0] in err and "--synthetic" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]


def test_a_plot_path_without_a_suffix_is_the_file_written(tmp_path: Path) -> None:
    """Regression: ``--plot PATH`` wrote ``PATH.png`` and left PATH unwritten."""
    pytest.importorskip("matplotlib")
    assert main(["plan", "--synthetic", "rag", *SMALL, "--plot", str(tmp_path / "plot")]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["plot"]
    assert (tmp_path / "plot").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--synthetic", "chat", "--policies", "lru,nosuch"], "no policy is registered as nosuch"),
        (["plan", "--synthetic", "chat", "--policies", ","], "names no policy"),
        (["bench", "policies", "--policy-names", "nosuch"], "no policy is registered as nosuch"),
    ],
)
def test_an_unknown_or_empty_policy_list_is_a_usage_error_before_anything_runs(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Regression: unknown names failed late (exit 1) and "," meant every policy.
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_trace_files_block_size_given_with_a_synthetic_trace_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """Regression: ``plan --synthetic chat --trace-block-tokens 64`` ignored the option and exited 0."""
    assert main(["plan", "--synthetic", "chat", *SMALL, "--trace-block-tokens", "64"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--trace-block-tokens reads a --trace file" in err


def test_a_trace_without_reuse_sizes_no_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Regression: a trace in which no chunk comes back recommended "cpu: 1 chunks" and
    "nvme: 1 chunks" reaching a hit rate of 0 (its target, 0.9 x a bound of 0)."""
    trace, out = tmp_path / "once.jsonl", tmp_path / "plan.json"
    lines = [f'{{"timestamp": {i}, "input_length": 1024, "hash_ids": [{2 * i}, {2 * i + 1}]}}' for i in range(6)]
    trace.write_text("\n".join(lines) + "\n")
    assert main(["plan", "--trace", str(trace), "--chunk-tokens", "512", "--json", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "no chunk of this trace is looked up twice" in stdout and "chunks =" not in stdout
    plan = json.loads(out.read_text())
    assert plan["compulsory_hit_rate"] == 0 and plan["sizings"] == []


def test_a_reader_that_closes_the_report_early_ends_the_plan_quietly_with_its_files_written(tmp_path: Path) -> None:
    """``tiered-kv plan ... | head``: regression, the report's print raised BrokenPipeError,
    the command said "error: [Errno 32] Broken pipe", exited 1 and wrote no --json."""
    out = tmp_path / "plan.json"
    result = run_with_output_closed("plan", "--synthetic", "chat", *SMALL, "--json", str(out))
    assert result.returncode == EXIT_OUTPUT_CLOSED
    assert "error" not in result.stderr and "Broken pipe" not in result.stderr, result.stderr
    assert json.loads(out.read_text())["trace"] == "chat"


def test_a_broken_pipe_that_is_not_standard_output_is_a_failure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only a closed standard output ends a command quietly; a connection of its own that
    breaks is a failure with its reason."""

    def broken(args: object) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("tiered_kv.plan_command.run_plan", broken)
    assert main(["plan", "--synthetic", "chat"]) == 1
    assert "error: [Errno 32] Broken pipe" in capsys.readouterr().err

"""``tiered-kv bench policies`` at a small size: the tables and the JSON document."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from tiered_kv.cli import main

SMALL = [
    "--policy-entries",
    "3000",
    "--policy-lookups",
    "2000",
    "--policy-cycles",
    "1000",
    "--policy-repeats",
    "1",
    "--policy-trace-scale",
    "0.03",
]


def test_bench_policies_reports_hit_rates_and_ops_as_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "policies", *SMALL, "--json", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "policies: chunk hit rate per trace" in stdout and "3,000 entries" in stdout
    document = json.loads(out.read_text())
    assert document["schema"] == 1 and document["errors"] == []
    hit_rates, ops = document["policies"]["hit_rates"], document["policies"]["ops"]
    traces = {"chat", "system_prompt", "rag", "scan", "scan_polluted"}
    assert {row["trace"] for row in hit_rates} == traces
    ours = {"arc", "lru", "s3fifo", "arc+seen_adaptive", "lru+seen_adaptive", "s3fifo+seen_adaptive", "lru+seen_k"}
    labels = ours | {"lru-plain", "vllm-lru", "vllm-arc", "min"}
    assert {row["policy"] for row in hit_rates} == labels
    assert len(hit_rates) == len(traces) * 2 * len(labels)  # two capacities by default
    for trace in traces:
        for capacity in {row["capacity_chunks"] for row in hit_rates if row["trace"] == trace}:
            at = {
                row["policy"]: row["hit_rate"]
                for row in hit_rates
                if (row["trace"], row["capacity_chunks"]) == (trace, capacity)
            }
            assert max(at.values()) == at["min"]  # nothing beats the offline optimum
    for row in hit_rates:
        assert set(row) == {"trace", "capacity_chunks", "policy", "hit_rate"}
        assert isinstance(row["capacity_chunks"], int) and 0 <= row["hit_rate"] <= 1
    assert [row["policy"] for row in ops] == ["arc", "lru", "s3fifo"]
    for row in ops:
        assert set(row) == {"policy", "entries", "lookups_per_s", "insert_evict_per_s", "bytes_per_entry"}
        assert row["entries"] == 3000
        assert row["lookups_per_s"] > 0 and row["insert_evict_per_s"] > 0 and row["bytes_per_entry"] > 16


def test_bench_policies_can_name_policies_and_capacities(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["bench", "policies", *SMALL, "--policy-names", "lru", "--policy-capacities", "0.1", "--json", str(out)]
    assert main(args) == 0
    document = json.loads(out.read_text())["policies"]
    assert {row["policy"] for row in document["hit_rates"]} == {
        "lru",
        "lru+seen_adaptive",
        "lru+seen_k",
        "lru-plain",
        "vllm-lru",
        "vllm-arc",
        "min",
    }
    assert [row["policy"] for row in document["ops"]] == ["lru"]


def test_bad_capacity_fractions_are_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "policies", "--policy-capacities", "0,2"])
    assert "fractions must lie in (0, 1]" in capsys.readouterr().err


def test_bench_policies_replays_a_trace_file(tmp_path: Path) -> None:
    trace = tmp_path / "mine.jsonl"
    trace.write_text(
        "\n".join(f'{{"timestamp": {i}, "input_length": 1100, "hash_ids": [0, {i % 3 + 1}, {i}]}}' for i in range(60))
        + "\nnot a request\n"
    )
    out = tmp_path / "bench.json"
    args = ["bench", "policies", *SMALL, "--trace", str(trace), "--trace-chunk-tokens", "512", "--json", str(out)]
    assert main(args) == 0
    rows = json.loads(out.read_text())["policies"]["hit_rates"]
    assert {row["trace"] for row in rows} == {"mine.jsonl"}
    assert all(row["hit_rate"] > 0 for row in rows if row["policy"] == "min")


def test_bench_policies_refuses_a_file_that_is_not_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "notes.txt"
    trace.write_text("hello\n")
    with pytest.raises(SystemExit) as exit_status:
        main(["bench", "policies", *SMALL, "--trace", str(trace)])
    assert exit_status.value.code == 2
    err = capsys.readouterr().err
    assert "argument --trace: notes.txt is not a Mooncake-format trace" in err and "Traceback" not in err


def _trace_rows(requests: int) -> str:
    return "".join(
        f'{{"timestamp": {i}, "input_length": 1100, "hash_ids": [0, {i % 3 + 1}, {i}]}}\n' for i in range(requests)
    )


def test_bench_policies_replays_a_pipe_whole(tmp_path: Path) -> None:
    """Regression: --trace was read once to check it and again by the section, so a pipe
    was replayed from where the check had stopped, some requests short, silently."""
    rows = _trace_rows(3000)
    (tmp_path / "file").mkdir()
    (tmp_path / "file" / "mine.jsonl").write_text(rows)
    (tmp_path / "pipe").mkdir()
    fifo = tmp_path / "pipe" / "mine.jsonl"
    os.mkfifo(fifo)
    writer = threading.Thread(target=fifo.write_text, args=(rows,))
    writer.start()
    figures = []
    for path in (fifo, tmp_path / "file" / "mine.jsonl"):
        out = tmp_path / "bench.json"
        assert (
            main(["bench", "policies", *SMALL, "--trace", str(path), "--trace-chunk-tokens", "512", "--json", str(out)])
            == 0
        )
        figures.append(json.loads(out.read_text())["policies"]["hit_rates"])
    writer.join()
    assert figures[0] == figures[1]


def test_bench_refuses_a_trace_in_another_block_size_before_any_section_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: the block size was checked only by each section, which then failed (exit 1)."""
    trace = tmp_path / "mine.jsonl"
    trace.write_text(_trace_rows(10))
    with pytest.raises(SystemExit) as exit_status:
        main(["bench", "policies", *SMALL, "--trace", str(trace), "--trace-block-tokens", "256"])
    assert exit_status.value.code == 2
    err = capsys.readouterr().err
    assert "argument --trace: mine.jsonl is not a Mooncake-format trace" in err and "needs 5 blocks of 256" in err
    assert "[policies]" not in err  # no section started


def test_bench_reports_a_deeply_nested_line_as_bad(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Regression: a first line nested 100,000 deep raised RecursionError, a traceback."""
    trace = tmp_path / "mine.jsonl"
    nested = (
        '{"timestamp": 0, "input_length": 1100, "hash_ids": [0, 1, 2], "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
    )
    trace.write_text(nested + _trace_rows(10))
    assert main(["bench", "policies", *SMALL, "--trace", str(trace), "--trace-chunk-tokens", "512"]) == 0
    assert "mine.jsonl: skipped 1 bad lines (line 1: JSON nested too deeply)" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--trace-block-tokens", "--trace-chunk-tokens"])
def test_bench_refuses_blocks_and_chunks_too_large_to_key(
    tmp_path: Path, option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "mine.jsonl"
    trace.write_text(_trace_rows(10))
    with pytest.raises(SystemExit) as exit_status:
        main(["bench", "policies", "--trace", str(trace), option, "8589934592"])
    assert exit_status.value.code == 2
    assert f"argument {option}: must be at most 1,048,576, got '8589934592'" in capsys.readouterr().err

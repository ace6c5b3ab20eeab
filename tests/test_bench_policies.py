"""``tiered-kv bench policies`` at a small size: the tables and the JSON document."""

from __future__ import annotations

import json
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

"""``tiered-kv bench workload --trace FILE``: a Mooncake-format file through a real
TieredKV, with its arrival times in the time to first token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiered_kv.bench.workload import mean_ttft_s
from tiered_kv.cli import main

TINY = ["--model", "custom", "--layers", "2", "--kv-heads", "1", "--head-dim", "8", "--trace-chunk-tokens", "64"]


def test_a_request_waits_for_the_ones_before_it_only_when_arrivals_are_known() -> None:
    services = [1.0, 1.0, 1.0]
    assert mean_ttft_s(services, None) == 1.0
    assert mean_ttft_s(services, [0.0, 0.0, 10.0]) == pytest.approx((1 + 2 + 1) / 3)
    assert mean_ttft_s(services, [0.0, 0.5, 1.0]) == pytest.approx((1 + 1.5 + 2) / 3)


def test_bench_workload_replays_a_trace_file_with_its_arrivals(tmp_path: Path) -> None:
    trace = tmp_path / "conversation.jsonl"
    # Four blocks of 64 tokens (the last one partial), sharing their first one or two blocks.
    rows = [
        f'{{"timestamp": {50 * i}, "input_length": {256 - 10 * (i % 3)}, "hash_ids": [0, {i % 4 + 1}, {i}, {99 + i}]}}'
        for i in range(24)
    ]
    trace.write_text("\n".join(rows) + "\n")
    out = tmp_path / "bench.json"
    args = ["bench", "workload", *TINY, "--trace", str(trace), "--trace-block-tokens", "64"]
    assert main([*args, "--workload-requests", "20", "--nvme-dir", str(tmp_path), "--json", str(out)]) == 0
    (figures,) = json.loads(out.read_text())["workload"]["traces"]
    assert figures["trace"] == "conversation.jsonl" and figures["requests"] == 20 and figures["arrivals"]
    assert figures["tokens_from_cache"] > 0 and figures["hit_rate_cpu"] + figures["hit_rate_nvme"] > 0
    assert figures["ttft_cached_ms"] > 0 and figures["ttft_recompute_ms"] > 0

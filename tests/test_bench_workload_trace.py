"""``tiered-kv bench workload --trace FILE``: a Mooncake-format file through a real
TieredKV, with its arrival times in the time to first token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiered_kv.bench import workload
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


def _repeated_prompt(tmp_path: Path, hash_ids: int) -> Path:
    """Three requests for one prompt of ``hash_ids`` blocks of 64 tokens."""
    trace = tmp_path / "long.jsonl"
    ids = list(range(hash_ids))
    trace.write_text(
        "".join(json.dumps({"timestamp": i, "input_length": 64 * hash_ids, "hash_ids": ids}) + "\n" for i in range(3))
    )
    return trace


def test_bench_workload_loads_prompts_longer_than_32_chunks(tmp_path: Path) -> None:
    # 40 chunks of 64 tokens: the engine's block table used to wrap at 32 chunks, naming
    # block 0 twice, and every load was rejected while the section reported 0 tokens cached.
    trace = _repeated_prompt(tmp_path, 40)
    out = tmp_path / "bench.json"
    args = ["bench", "workload", *TINY, "--trace", str(trace), "--trace-block-tokens", "64", "--cpu-fraction", "1"]
    assert main([*args, "--nvme-dir", str(tmp_path), "--json", str(out)]) == 0
    (figures,) = json.loads(out.read_text())["workload"]["traces"]
    assert figures["tokens_from_cache"] == 2 * 40 * 64


def test_a_replay_whose_loads_the_manager_rejects_fails_the_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # An engine whose block table wraps at one chunk, storing a chunk at a time: its stores
    # go through, but a load of several chunks names each block more than once.
    monkeypatch.setattr(workload, "STORE_BATCH", 1)
    monkeypatch.setattr(
        workload, "block_table", lambda geometry, request: [*range(geometry.blocks_per_chunk)] * len(request.keys)
    )
    trace = _repeated_prompt(tmp_path, 4)
    args = ["bench", "workload", *TINY, "--trace", str(trace), "--trace-block-tokens", "64", "--cpu-fraction", "1"]
    assert main([*args, "--nvme-dir", str(tmp_path)]) == 1
    assert (
        "RejectedLoads: the manager rejected loads of the bench's engine (2 for block_table)" in capsys.readouterr().err
    )

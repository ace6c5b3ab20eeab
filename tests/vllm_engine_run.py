"""One run of a real vLLM engine over the tiny Llama, as a child process of the e2e tests.

Each run is a fresh engine process tree, as a server would start it: this front end, vLLM's
engine-core process (the scheduler) and, with the multiprocessing executor, a worker process of
its own (the model runner and its KV cache). The run generates greedily on prompts that share a
long prefix, in steps (``--steps``, by default):

- cold: nothing cached; the reference output.
- repeat: same prompts; the engine's own GPU prefix cache serves the prefix.
- reset: `reset_prefix_cache()` (the engine's cache only, not a connector's).
- after_reset: same prompts; the engine's cache is empty again.

Other steps: `filler*` generates other prompts (a connector's small cpu tier then holds
their chunks instead), `head*` a prompt sharing only the first blocks of the prefix (a later
load then starts inside a chunk), `corrupt` flips a byte of an nvme slot on disk.

It writes one JSON report: per generation step the generated token ids and
`num_cached_tokens` per request, the engine's prefix-cache counters (local, connector, and
cached tokens by source tier), timings; plus the process tree, so a test can check that the
scheduler and the worker ran in different processes.

Runs in the engine's interpreter:
    python tests/vllm_engine_run.py --model DIR --out REPORT.json [--kv-transfer-config JSON] [--steps ...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

_T0 = time.monotonic()

BLOCK_SIZE = 32  # the CPU attention backend needs a multiple of 32
DEFAULT_STEPS = ("cold", "repeat", "reset", "after_reset")
#: How long the engine core may take to end once told to. vLLM's default, 5 s, is what its
#: own teardown (the worker's exit, then its process group) takes on a busy 2-core machine:
#: past it the engine core is killed before the connector's shutdown writes its statistics.
SHUTDOWN_TIMEOUT_S = 120.0
#: A shutdown still running after this long is stuck: every engine process then prints
#: each thread's kernel wait channel and Python stack (py-spy) into the log, before vLLM
#: kills it, so that a failed run says where the engine core hung.
STACKS_AFTER_S = float(os.environ.get("TIERED_KV_E2E_STACKS_AFTER_S", "60"))


def dump_stacks_if_stuck(pids: list[int]) -> threading.Timer:
    """Started before the shutdown, cancelled after it."""
    spy = Path(sys.executable).with_name("py-spy")

    def dump() -> None:
        for pid in pids:
            try:
                waits = [f"{t.name}:{(t / 'wchan').read_text()}" for t in sorted(Path(f"/proc/{pid}/task").iterdir())]
            except OSError:
                continue  # ended meanwhile
            print(f"shutdown stuck after {STACKS_AFTER_S} s: pid {pid} threads waiting in {waits}", file=sys.stderr)
            stacks = subprocess.run([str(spy), "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
            print(stacks.stdout + stacks.stderr, file=sys.stderr, flush=True)

    timer = threading.Timer(STACKS_AFTER_S, dump)
    timer.daemon = True
    timer.start()
    return timer


def engine_env() -> None:
    """The environment vLLM reads at import: offline, a small CPU KV cache, processes split."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # engine core in its own process
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")


def prompts(n_prompts: int, prefix_blocks: int, suffix_tokens: int, seed: int) -> list[list[int]]:
    """Token-id prompts: one shared prefix of whole blocks, then a distinct suffix each."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 1024) for _ in range(prefix_blocks * BLOCK_SIZE)]
    return [prefix + [rng.randrange(3, 1024) for _ in range(suffix_tokens)] for _ in range(n_prompts)]


PREFIX_COUNTERS = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
)
#: Cached prompt tokens by where they came from, as the connector's get_load_source() tells
#: (device = the engine's own cache, host, disk, ...): `vllm:prompt_tokens_cached_by_source`.
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source"


def counters(llm: Any) -> dict[str, float]:
    """The engine's prefix-cache counters (tokens), summed over engines; the by-source counter
    appears as one entry per source, `<name>{<source>}`."""
    out = dict.fromkeys(PREFIX_COUNTERS, 0.0)
    for metric in llm.get_metrics():
        if metric.name in PREFIX_COUNTERS:
            out[metric.name] += float(metric.value)
        elif metric.name == CACHED_BY_SOURCE:
            name = f"{metric.name}{{{metric.labels['source']}}}"
            out[name] = out.get(name, 0.0) + float(metric.value)
    return out


def process_tree() -> list[dict[str, Any]]:
    """This process and its descendants: pid, parent pid, title."""
    import psutil

    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    return [{"pid": p.pid, "ppid": p.ppid(), "name": " ".join(p.cmdline()[:1]) or p.name()} for p in procs]


def flip_nvme_byte(root: Path, slot: int) -> None:
    """Corrupt nvme slot ``slot`` of KV group 0 on disk: one payload byte flipped, the slot
    map untouched (what a bad sector or a stray write does); checked by inspecting the store."""
    from tiered_kv.tiers.nvme import NvmeTier
    from tiered_kv.tiers.nvme_format import HEADER_BYTES, group_file, slot_stride

    [store] = NvmeTier.inspect(root).stores
    group = store.groups[0]
    assert group.slot_bytes is not None, store
    where = slot * slot_stride(group.slot_bytes) + HEADER_BYTES + 1000
    with (Path(store.directory) / group_file(0, "slots")).open("r+b") as f:
        f.seek(where)
        byte = f.read(1)[0]
        f.seek(where)
        f.write(bytes([byte ^ 0xFF]))
    corrupt = [c.slot for c in NvmeTier.inspect(root, verify=True).stores[0].groups[0].corrupt]
    if corrupt != [slot]:
        raise SystemExit(f"flipping a byte of nvme slot {slot} made slots {corrupt} corrupt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prefix-blocks", type=int, default=16)
    parser.add_argument("--suffix-tokens", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kv-transfer-config", type=json.loads, default=None, help="JSON, as vllm serve's --kv-transfer-config"
    )
    parser.add_argument(
        "--steps",
        default=",".join(DEFAULT_STEPS),
        help="comma-separated: reset (the engine's prefix cache only), corrupt (an nvme slot), or a generation "
        "named filler* (other prompts), head* (a prompt sharing the prefix's first --head-blocks blocks) or "
        "anything else (the prompts)",
    )
    parser.add_argument("--head-blocks", type=int, default=5)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--nvme-root", type=Path, help="the nvme root of the corrupt step")
    parser.add_argument("--corrupt-slot", type=int, default=2)
    args = parser.parse_args()

    engine_env()
    from vllm import LLM, SamplingParams

    imported = time.monotonic()
    llm = LLM(
        model=str(args.model),
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        block_size=BLOCK_SIZE,
        dtype="float32",
        enforce_eager=True,
        distributed_executor_backend="mp",  # the worker in a process of its own, even at TP=1
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=2048,
        seed=args.seed,
        disable_log_stats=False,  # the prefix-cache counters
        kv_transfer_config=args.kv_transfer_config,
    )
    started = time.monotonic()
    tree = process_tree()

    batch = prompts(args.prompts, args.prefix_blocks, args.suffix_tokens, args.seed)
    fillers = [prompts(1, args.prefix_blocks, args.suffix_tokens, args.seed + 1000 + i)[0] for i in range(args.prompts)]
    head = batch[0][: args.head_blocks * BLOCK_SIZE] + prompts(1, 0, args.suffix_tokens, args.seed + 2000)[0]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    phases: dict[str, dict[str, Any]] = {}
    for step in args.steps.split(","):
        if step == "reset":
            if not llm.reset_prefix_cache():
                raise SystemExit("reset_prefix_cache() refused")
            continue
        if step == "corrupt":
            flip_nvme_byte(args.nvme_root, args.corrupt_slot)
            continue
        chosen = fillers if step.startswith("filler") else [head] if step.startswith("head") else batch
        before = counters(llm)
        t0 = time.monotonic()
        outputs = llm.generate([{"prompt_token_ids": p} for p in chosen], params, use_tqdm=False)
        seconds = time.monotonic() - t0
        after = counters(llm)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        phases[step] = {
            "tokens": tokens,
            "num_cached_tokens": [o.num_cached_tokens for o in outputs],
            "counters": {name: after[name] - before[name] for name in after},
            "seconds": seconds,
            "generated_tokens_per_s": sum(map(len, tokens)) / seconds,
            "prompt_tokens_per_s": sum(map(len, chosen)) / seconds,
        }
    report = {
        "prompt_lengths": [len(p) for p in batch],
        "prefix_tokens": args.prefix_blocks * BLOCK_SIZE,
        "head_tokens": args.head_blocks * BLOCK_SIZE,
        "block_size": BLOCK_SIZE,
        "import_s": imported - _T0,
        "engine_start_s": started - imported,
        "processes": tree,
        "phases": phases,
    }
    watchdog = dump_stacks_if_stuck([p["pid"] for p in tree[1:]])
    llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_TIMEOUT_S)  # LLM has no public shutdown in 0.32
    watchdog.cancel()
    report["shutdown_s"] = time.monotonic() - _T0 - report["import_s"] - report["engine_start_s"]
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

"""``tiered-kv plan``: how much cpu and nvme, and which policy, for a trace of your traffic.

The trace is a Mooncake-format file (``--trace``; :mod:`tiered_kv.trace_file`), or one of
the bench's synthetic traces (``--synthetic``), which goes through the same writer and
reader (``--export`` keeps the file). Chunks are the model's (``--model``,
``--chunk-tokens``), and so are the bytes a recommendation costs. Prints the hit rate of
every policy and admission filter against capacity, next to the peers and MIN
(:mod:`tiered_kv.planner`), then the recommended tier sizes; ``--json`` writes the plan,
``--plot`` draws it. Exit status 0; 2 when the trace cannot be read.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path
from typing import Any, TextIO

from tiered_kv.bench.models import add_model_arguments, model_from_args
from tiered_kv.bench.report import Progress, Table
from tiered_kv.cli_errors import (
    UsageError,
    comma_list,
    output_file,
    png_file,
    policy_names,
    positive_float,
    positive_int,
    positive_int_up_to,
    write_json,
)
from tiered_kv.errors import TieredKVError
from tiered_kv.optimum import compulsory_bound
from tiered_kv.planner import Plan, candidates, capacity_grid, make_plan
from tiered_kv.registry import ADMISSION_FILTERS, POLICIES
from tiered_kv.trace_file import MOONCAKE_BLOCK_TOKENS, FileTrace, parse_lines, read_trace, trace_lines
from tiered_kv.traces import MAX_CHUNK_TOKENS, STANDARD_TRACES, standard_traces

#: Exit status when the trace cannot be read.
EXIT_BAD_TRACE = 2
#: Default targets: the nvme tier reaches this share of what the trace allows; the cpu tier half of that.
DEFAULT_TARGET_SHARE = 0.9
DEFAULT_CPU_SHARE = 0.5


#: The model whose chunk sizes price a recommendation, unless --model names another.
DEFAULT_MODEL = "llama-1b"


def _capacities(text: str) -> list[int]:
    try:
        values = sorted({int(part) for part in comma_list(text)})
    except ValueError:
        raise argparse.ArgumentTypeError(f"capacities are chunk counts, got {text!r}") from None
    if not values or values[0] <= 0:
        raise argparse.ArgumentTypeError(f"capacities must be positive chunk counts, got {text!r}")
    return values


def _rate(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"a hit rate lies in (0, 1], got {text!r}")
    return value


def add_plan_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="hit rate against capacity for every policy on a trace, and the cpu/nvme sizes to reach a target",
        description="Replay a Mooncake-format trace (or a synthetic one of the bench) through every policy and "
        "admission filter at a grid of capacities, next to other engines' orderings, the offline optimum (MIN) and "
        "the compulsory-miss bound; recommend cpu and nvme sizes for target hit rates, in chunks and in bytes of "
        "the chosen model. Exit status 0, 2 when the trace cannot be read.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", type=Path, metavar="FILE", help="a Mooncake-format trace (JSONL)")
    source.add_argument("--synthetic", choices=STANDARD_TRACES, help="one of the bench's synthetic traces")
    parser.add_argument(
        "--trace-block-tokens",
        type=positive_int_up_to(MAX_CHUNK_TOKENS),
        metavar="N",
        help=f"tokens per hash id in --trace (default {MOONCAKE_BLOCK_TOKENS})",
    )
    parser.add_argument("--scale", type=positive_float, help="--synthetic: length factor (default 1)")
    parser.add_argument("--seed", type=int, help="--synthetic: seed (default 0)")
    parser.add_argument("--export", type=output_file, metavar="FILE", help="--synthetic: also write the trace there")
    parser.add_argument("--capacities", type=_capacities, metavar="CHUNKS", help="comma-separated capacities")
    parser.add_argument("--points", type=positive_int, default=10, help="capacities in the grid (default 10)")
    parser.add_argument("--smallest", type=positive_int, default=256, help="the grid's smallest capacity (default 256)")
    parser.add_argument(
        "--policies", type=policy_names, metavar="NAMES", help="policies (default: every registered one)"
    )
    parser.add_argument(
        "--target-hit-rate",
        type=_rate,
        metavar="RATE",
        help=f"the nvme tier's target (default {DEFAULT_TARGET_SHARE * 100:.0f}%% of the compulsory-miss bound)",
    )
    parser.add_argument(
        "--cpu-hit-rate",
        type=_rate,
        metavar="RATE",
        help=f"the cpu tier's (default {DEFAULT_CPU_SHARE * 100:.0f}%% of that)",
    )
    parser.add_argument("--json", type=output_file, metavar="PATH", help="also write the plan as JSON")
    parser.add_argument("--plot", type=png_file, metavar="PATH", help="also draw it as a PNG (needs matplotlib)")
    model = parser.add_argument_group("model shape")
    add_model_arguments(model, {"plan": DEFAULT_MODEL})
    model.add_argument(
        "--chunk-tokens",
        type=positive_int_up_to(MAX_CHUNK_TOKENS),
        default=256,
        help="tokens per offload chunk (default 256)",
    )
    parser.set_defaults(handler=run_plan)


def load_trace(args: argparse.Namespace, chunk_tokens: int) -> FileTrace:
    """The trace ``args`` name, keyed at ``chunk_tokens``: read from ``--trace``, or a
    synthetic one written in the format and read back."""
    if args.trace is not None:
        given = [f"--{name}" for name in ("scale", "seed", "export") if getattr(args, name) is not None]
        if given:
            raise UsageError(f"{', '.join(given)} shape a --synthetic trace; --trace reads one as it is")
        block_tokens = args.trace_block_tokens or MOONCAKE_BLOCK_TOKENS
        return read_trace(args.trace, block_tokens=block_tokens, chunk_tokens=chunk_tokens)
    if args.trace_block_tokens is not None:
        raise UsageError("--trace-block-tokens reads a --trace file; a --synthetic trace is keyed at --chunk-tokens")
    seed, scale = args.seed or 0, args.scale or 1.0
    requests = standard_traces(seed, scale=scale, chunk_tokens=chunk_tokens)[args.synthetic]
    data = b"".join(trace_lines(requests, block_tokens=chunk_tokens))
    if args.export is not None:
        args.export.parent.mkdir(parents=True, exist_ok=True)
        args.export.write_bytes(data)
    return parse_lines(io.BytesIO(data), name=args.synthetic, block_tokens=chunk_tokens, chunk_tokens=chunk_tokens)


def run_plan(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    namespace = model_from_args(args, DEFAULT_MODEL).namespace(args.chunk_tokens)
    geometry = namespace.geometry
    chunk_bytes = sum(geometry.chunk_bytes(g) for g in range(len(geometry.groups)))
    try:
        trace = load_trace(args, geometry.chunk_size)
    except TieredKVError as exc:
        print(f"tiered-kv plan: {exc}", file=sys.stderr)
        return EXIT_BAD_TRACE
    if trace.bad_lines:
        print(trace.describe_bad_lines(), file=sys.stderr)
    if trace.out_of_order:
        print(f"{trace.name}: {trace.out_of_order} lines arrived out of order; replayed by timestamp", file=sys.stderr)
    requests = trace.requests
    working_set = len({key for request in requests for key in request.keys})
    if not working_set:
        print(f"tiered-kv plan: {trace.name} has no full chunk of {geometry.chunk_size} tokens", file=sys.stderr)
        return EXIT_BAD_TRACE
    grid = args.capacities or capacity_grid(working_set, points=args.points, smallest=args.smallest)
    policies = candidates(args.policies or POLICIES.names(), ADMISSION_FILTERS.names())
    target = args.target_hit_rate or DEFAULT_TARGET_SHARE * compulsory_bound(requests)
    cpu_target = args.cpu_hit_rate or DEFAULT_CPU_SHARE * target
    progress = Progress(sys.stderr)
    progress.section("plan")
    plan = make_plan(
        trace.name,
        requests,
        chunk_tokens=geometry.chunk_size,
        chunk_bytes=chunk_bytes,
        capacities=grid,
        policies=policies,
        targets=[("cpu", cpu_target), ("nvme", target)],
        progress=progress.step,
    )
    progress.done()
    # The files first: a reader that closes standard output early (``| head``) must not cost them.
    if args.json:
        write_json(args.json, plan)
    if args.plot:
        from tiered_kv.plan_plot import write_plan_plot

        write_plan_plot(plan, args.plot)
    print(render(plan, namespace.model_id), file=out)
    return 0


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def render(plan: Plan, model: str) -> str:
    """The plan for people: hit rates per capacity and curve, the best against the peers
    and MIN, and the recommended sizes."""
    names = [curve.name for curve in plan.curves]
    rates = Table(
        title=(
            f"plan: {plan.trace}, {plan.requests:,} requests, {plan.lookups:,} chunk lookups, "
            f"working set {plan.working_set_chunks:,} chunks of {plan.chunk_tokens} tokens"
        ),
        headers=["capacity", *names],
        rows=[
            [f"{capacity:,}", *(f"{curve.hit_rates[j]:.3f}" for curve in plan.curves)]
            for j, capacity in enumerate(plan.capacities)
        ],
        note=f"chunk hit rate, prefix semantics; compulsory-miss bound {plan.compulsory_hit_rate:.3f}",
    )
    by_name = {curve.name: curve for curve in plan.curves}
    peers = [curve for curve in plan.curves if curve.kind == "peer"]
    optimum = next(curve for curve in plan.curves if curve.kind == "optimum")
    rows = []
    for j, capacity in enumerate(plan.capacities):
        best = by_name[plan.best[j]] if plan.best else None
        peer = max(peers, key=lambda curve: curve.hit_rates[j]) if peers else None
        best_rate = best.hit_rates[j] if best else 0.0
        rows.append(
            [
                f"{capacity:,}",
                f"{best.name if best else '-'} {best_rate:.3f}",
                f"{peer.name if peer else '-'} {peer.hit_rates[j] if peer else 0.0:.3f}",
                f"{optimum.hit_rates[j]:.3f}",
                f"{best_rate / optimum.hit_rates[j]:.0%}" if optimum.hit_rates[j] else "-",
                f"{best.token_hit_rates[j] if best else 0.0:.3f}",
                _gib(capacity * plan.chunk_bytes),
            ]
        )
    summary = Table(
        title=f"best tiered-kv policy against the best peer and MIN ({model})",
        headers=["capacity", "best policy", "best peer", "MIN", "of MIN", "token hit rate", "bytes"],
        rows=rows,
    )
    lines = [rates.render(), "", summary.render(), ""]
    if not plan.compulsory_hit_rate:
        lines.append("no chunk of this trace is looked up twice: no tier of any size has a hit, so none is sized")
    elif not plan.sizings:
        lines.append("no policy reaches the targets on this grid")
    for sizing in plan.sizings:
        lines.append(
            f"{sizing.tier}: {sizing.chunks:,} chunks = {_gib(sizing.bytes)} for {model} "
            f"reach {sizing.hit_rate:.3f} (target {sizing.target_hit_rate:.3f}) with {sizing.curve}"
        )
    if plan.sizings:
        lines.append("(nvme is sized to hold the target's chunks on its own, as write-through keeps them)")
    return "\n".join(lines)

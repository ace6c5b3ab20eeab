"""One engine process of the sharing tests: stores chunks in a remote tier, or loads them
and reports which arrived and whether each was bit-exact (JSON on stdout).

    python tests/remote_engine.py store|load <url or host:port,...> <prefix> <variant>[,<variant>...]

A load reports per variant (each its own namespace, its own driver).
"""

from __future__ import annotations

import asyncio
import json
import sys

import msgspec
import torch
from conftest import make_namespace
from tiered_kv.tiers.remote import RemoteTier

from tiered_kv.config import RemoteTierConfig
from tiered_kv.interfaces import TransferOp
from tiered_kv.namespace import Namespace
from tiered_kv.testing.tiers import chunk_data

CHUNKS, CHUNK_BYTES = 8, 64 << 10


def namespace(variant: str) -> Namespace:
    """The engines' namespace, or one that differs in a single byte-deciding field."""
    base = make_namespace()
    variants: dict[str, dict[str, object]] = {
        "same": {},
        "revision": {"model_revision": "r2"},
        "dtype": {"geometry": msgspec.structs.replace(base.geometry, dtype="bfloat16")},
        "tp": {"tp_size": 2},
        "salt": {"cache_salt": "tenant-b"},
    }
    return make_namespace(**variants[variant])


async def main(action: str, where: str, prefix: str, variants: str) -> dict[str, object]:
    if where.startswith("redis://"):
        config = RemoteTierConfig(url=where, prefix=prefix)
    else:
        config = RemoteTierConfig(cluster_nodes=where.split(","), prefix=prefix)
    return {variant: await run(action, config, variant) for variant in variants.split(",")}


async def run(action: str, config: RemoteTierConfig, variant: str) -> dict[str, object]:
    tier = await RemoteTier.open(config, namespace(variant), slot_bytes=CHUNK_BYTES, num_slots=CHUNKS)
    try:
        want = [chunk_data(CHUNK_BYTES, "bfloat16", seed=i) for i in range(CHUNKS)]
        keys = [i.to_bytes(16, "little") for i in range(CHUNKS)]
        if action == "store":
            stored = await tier.write_each([TransferOp(buffer=b, key=k) for b, k in zip(want, keys, strict=True)])
            return {"stored": stored}
        got = [torch.zeros(CHUNK_BYTES, dtype=torch.uint8) for _ in range(CHUNKS)]
        found = await tier.read_each([TransferOp(buffer=b, key=k) for b, k in zip(got, keys, strict=True)])
        exact = [bool(torch.equal(a, b)) for a, b in zip(got, want, strict=True)]
        return {"found": found, "exact": exact}
    finally:
        await tier.close()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*sys.argv[1:5]))))

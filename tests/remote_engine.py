"""One engine process of the sharing tests: a ``TieredKV`` with a cpu tier and the remote
tier that stores a prompt's chunks, or looks them up and loads them and reports which
arrived and whether each was bit-exact (JSON on stdout).

    python tests/remote_engine.py store|load <url or host:port,...> <prefix> <variant>[,<variant>...]

A load reports per variant (each its own namespace, its own manager): it looks up, lets
the probe that queued answer, looks up again and loads what was found.
"""

from __future__ import annotations

import asyncio
import json
import sys

import msgspec
import torch
from conftest import make_namespace
from test_manager_data import engine_cache

from tiered_kv import CpuTierConfig, TieredKV, TieredKVConfig, chunk_keys
from tiered_kv.config import RemoteTierConfig
from tiered_kv.namespace import Namespace
from tiered_kv.stats import KVEventKind

CHUNKS = 8
PROMPT = list(range(7000, 7000 + CHUNKS * 16))
NUM_BLOCKS = 2 * CHUNKS * 4
#: The engine that stores: its KV cache (seeded) holds the prompt in blocks 0 … 31.
STORED_SEED = 1


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
        remote = RemoteTierConfig(url=where, prefix=prefix, timeout_s=5.0)
    else:
        remote = RemoteTierConfig(cluster_nodes=where.split(","), prefix=prefix, timeout_s=5.0)
    ns = namespace("same")
    config = TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=2 * CHUNKS * ns.geometry.chunk_bytes()), remote=remote)
    return {variant: await run(action, config, variant) for variant in variants.split(",")}


async def run(action: str, config: TieredKVConfig, variant: str) -> dict[str, object]:
    ns = namespace(variant)
    keys = chunk_keys(ns, PROMPT)
    per_chunk = ns.geometry.blocks_per_chunk
    async with TieredKV(config) as kv:
        if action == "store":
            await kv.register(ns, [engine_cache(NUM_BLOCKS, seed=STORED_SEED, ns=ns)])
            await kv.store(ns, request_id="prefill", keys=[keys], block_ids=[list(range(CHUNKS * per_chunk))])
            await kv.finish_request("prefill")
            await kv.drain()  # the remote writes landed, or failed
            landed = {
                event.key for event in kv.drain_events() if (event.tier, event.kind) == ("remote", KVEventKind.STORED)
            }
            return {"stored": [key in landed for key in keys]}
        cache = [torch.zeros_like(layer) for layer in engine_cache(NUM_BLOCKS, ns=ns)]
        await kv.register(ns, [cache])
        kv.lookup(ns, [keys])
        await kv.drain()
        hit = kv.lookup(ns, [keys])
        dest = list(range(CHUNKS * per_chunk, 2 * CHUNKS * per_chunk))
        tokens = await kv.load(
            ns, request_id="l", keys=[keys], block_ids=[dest], num_tokens=hit * ns.geometry.chunk_size
        )
        loaded = tokens // ns.geometry.chunk_size
        want = engine_cache(NUM_BLOCKS, seed=STORED_SEED, ns=ns)
        exact = [
            all(
                torch.equal(
                    mine[dest[c * per_chunk : (c + 1) * per_chunk]], theirs[c * per_chunk : (c + 1) * per_chunk]
                )
                for mine, theirs in zip(cache, want, strict=True)
            )
            for c in range(loaded)
        ]
        return {"found": [c < loaded for c in range(CHUNKS)], "exact": exact}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*sys.argv[1:5]))))

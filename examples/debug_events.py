"""Follow requests through tiered-kv's structlog events (see docs/debugging.md).

Request A stores a prompt of a hybrid model (full attention + a 4096-token sliding
window), request B loads it back, and request C hands in a window span one block too long
— the bug that crashed a production engine — which tiered-kv rejects as a miss.

Run: ``python examples/debug_events.py`` — JSON lines on stderr, one per event.
"""

from __future__ import annotations

import asyncio

import torch

from tiered_kv import (
    AttentionKind,
    CpuTierConfig,
    KVGeometry,
    KVGroup,
    Namespace,
    TieredKV,
    TieredKVConfig,
    chunk_keys,
    window_span,
)
from tiered_kv.cli import configure_logging


async def main() -> None:
    configure_logging("json", "debug")
    geometry = KVGeometry(
        dtype="bfloat16",
        block_size=32,
        chunk_size=256,
        groups=(
            KVGroup(num_layers=1, num_kv_heads=1, head_dim=8),
            KVGroup(kind=AttentionKind.SLIDING_WINDOW, window=4096, num_layers=1, num_kv_heads=1, head_dim=8),
        ),
    )
    namespace = Namespace(model_id="example/hybrid", model_revision="main", geometry=geometry)
    caches = [[torch.zeros(200, 2, 32, 1, 8, dtype=torch.bfloat16)] for _ in range(2)]
    prompt = list(range(5120))  # 20 chunks
    keys = [chunk_keys(namespace, prompt, group=0), chunk_keys(namespace, prompt, group=1)]
    table = list(range(160))
    span = window_span(5000, 4096, 32)  # the blocks the next token attends to

    config = TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=64 * 2 * geometry.chunk_bytes()))
    async with TieredKV(config) as kv:
        await kv.register(namespace, caches)
        await kv.store(namespace, request_id="A", keys=keys, block_ids=[table, table])
        await kv.finish_request("A")
        kv.lookup(namespace, keys)
        await kv.load(namespace, request_id="B", keys=keys, block_ids=[table, list(span)], num_tokens=5000)
        too_long = list(range(len(span) + 1))
        await kv.load(namespace, request_id="C", keys=keys, block_ids=[table, too_long], num_tokens=5000)


if __name__ == "__main__":
    asyncio.run(main())

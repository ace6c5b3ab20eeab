"""Embedding tiered-kv in an engine: offload a prompt's KV chunks, then load them back.

Run: ``python examples/embed.py``. It uses the CPU stand-in for the GPU tier, so it runs
anywhere; with CUDA, pass CUDA tensors and the same code copies on CUDA streams.
"""

from __future__ import annotations

import asyncio
import tempfile

import torch

from tiered_kv import (
    CpuTierConfig,
    KVGeometry,
    KVGroup,
    Namespace,
    NvmeTierConfig,
    TieredKV,
    TieredKVConfig,
    chunk_keys,
)


async def main() -> None:
    geometry = KVGeometry(
        dtype="float16", block_size=16, chunk_size=64, groups=(KVGroup(num_layers=4, num_kv_heads=2, head_dim=64),)
    )
    namespace = Namespace(model_id="example/tiny", model_revision="main", geometry=geometry)
    # The engine's paged KV cache: one tensor per layer, [num_blocks, K/V, block_size, heads, head_dim].
    kv_cache = [torch.randn(64, 2, 16, 2, 64).half() for _ in range(4)]

    with tempfile.TemporaryDirectory() as nvme_root:
        config = TieredKVConfig(
            cpu=CpuTierConfig(capacity_bytes=16 * geometry.chunk_bytes()),
            nvme=NvmeTierConfig(root=nvme_root, capacity_bytes=64 * geometry.chunk_bytes()),
        )
        async with TieredKV(config) as kv:
            await kv.register(namespace, [kv_cache])  # one tensor list per KV group
            prompt = list(range(1000, 1256))  # 256 tokens: 4 chunks of 64
            keys = chunk_keys(namespace, prompt)

            # Request A computed the prompt into GPU blocks 0..15: offload its chunks.
            await kv.store(namespace, request_id="A", keys=[keys], block_ids=[list(range(16))])
            await kv.finish_request("A")  # the engine may now free blocks 0..15

            # Request B has the same prompt; the engine gives it blocks 32..47.
            hit_chunks = kv.lookup(namespace, [keys])
            loaded = await kv.load(
                namespace,
                request_id="B",
                keys=[keys],
                block_ids=[list(range(32, 48))],
                num_tokens=hit_chunks * geometry.chunk_size,
            )
            assert all(torch.equal(layer[0:16], layer[32:48]) for layer in kv_cache)
            print(f"loaded {loaded} tokens from cache: {kv!r}")


if __name__ == "__main__":
    asyncio.run(main())

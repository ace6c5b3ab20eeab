"""Chunk keys: spec v1 vectors, chaining, isolation and typed errors."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
from conftest import make_namespace, mla_geometry

from tiered_kv import ChunkKeyError, KVGeometry, KVGroup, block_hashes, chunk_keys, chunk_keys_from_block_hashes


def reference_chunk_keys(fingerprint: bytes, tokens: list[int], block: int, per_chunk: int, group: int) -> list[bytes]:
    """Spec v1 (docs/keys.md) written out independently of the implementation."""
    parent = hashlib.sha256(b"tiered-kv/blocks/v1\0" + fingerprint).digest()
    hashes = []
    for i in range(len(tokens) // block):
        parent = hashlib.sha256(parent + struct.pack(f"<{block}I", *tokens[i * block : (i + 1) * block])).digest()
        hashes.append(parent)
    return [
        hashlib.sha256(
            b"tiered-kv/chunk/v1\0" + struct.pack("<I", group) + hashes[c * per_chunk + per_chunk - 1]
        ).digest()[:16]
        for c in range(len(hashes) // per_chunk)
    ]


# Fixed vectors of spec v1 for make_namespace() (4-token blocks, 16-token chunks), tokens 0..39.
VECTORS = ["0317a8a10637bf6269c6e4a93c4f84db", "5fee5ba7db7a6906cd3be0c5c76f00d1"]


def test_spec_v1_vectors() -> None:
    keys = chunk_keys(make_namespace(), list(range(40)))
    assert [k.hex() for k in keys] == VECTORS


def test_keys_match_an_independent_reading_of_the_spec() -> None:
    ns = make_namespace()
    tokens = np.random.default_rng(1).integers(0, 2**32, 100, dtype=np.int64).tolist()
    assert chunk_keys(ns, tokens) == reference_chunk_keys(ns.fingerprint, tokens, 4, 4, 0)


def test_only_full_chunks_get_keys_and_keys_are_prefix_stable() -> None:
    ns = make_namespace()
    tokens = list(range(1000, 1063))  # 3 full chunks + 15 tokens
    keys = chunk_keys(ns, tokens)
    assert len(keys) == 3 and all(len(k) == 16 for k in keys)
    assert chunk_keys(ns, tokens[:48]) == keys
    assert chunk_keys(ns, tokens[:47]) == keys[:2]
    assert chunk_keys(ns, tokens[:15]) == []


def test_a_changed_token_changes_its_chunk_and_every_later_one() -> None:
    ns = make_namespace()
    tokens = list(range(64))
    changed = tokens.copy()
    changed[20] = 999
    before, after = chunk_keys(ns, tokens), chunk_keys(ns, changed)
    assert before[0] == after[0]
    assert all(b != a for b, a in zip(before[1:], after[1:], strict=True))


def test_numpy_and_list_inputs_agree() -> None:
    ns = make_namespace()
    tokens = np.arange(0, 320, dtype=np.int32)
    assert chunk_keys(ns, tokens) == chunk_keys(ns, tokens.tolist())


def test_extending_a_chain_from_a_parent_equals_hashing_at_once() -> None:
    ns = make_namespace()
    tokens = list(range(48))
    first = block_hashes(ns, tokens[:16])
    assert first + block_hashes(ns, tokens[16:], parent=first[-1]) == block_hashes(ns, tokens)


def test_keys_are_bound_to_namespace_and_group() -> None:
    tokens = list(range(32))
    a = chunk_keys(make_namespace(), tokens)
    assert a != chunk_keys(make_namespace(cache_salt="tenant-b"), tokens)
    hybrid = make_namespace(
        geometry=KVGeometry(
            dtype="float16",
            block_size=4,
            chunk_size=16,
            groups=(
                KVGroup(num_layers=1, num_kv_heads=1, head_dim=8),
                KVGroup(num_layers=1, num_kv_heads=1, head_dim=8),
            ),
        )
    )
    assert chunk_keys(hybrid, tokens, group=0) != chunk_keys(hybrid, tokens, group=1)


def test_replicated_ranks_share_keys() -> None:
    tokens = list(range(32))
    keys = {tuple(chunk_keys(make_namespace(geometry=mla_geometry(), tp_size=2, tp_rank=r), tokens)) for r in range(2)}
    assert len(keys) == 1


def test_engine_block_hashes_key_the_last_block_of_each_full_chunk() -> None:
    ns = make_namespace()
    hashes = [bytes([i]) * 32 for i in range(11)]  # 2 full chunks of 4 blocks + 3 blocks
    keys = chunk_keys_from_block_hashes(ns, hashes)
    assert len(keys) == 2
    # Only the chunk's last block hash decides the key.
    altered = hashes.copy()
    altered[0] = b"\xff" * 32
    assert chunk_keys_from_block_hashes(ns, altered) == keys
    altered[3] = b"\xfe" * 32
    assert chunk_keys_from_block_hashes(ns, altered)[0] != keys[0]
    assert chunk_keys_from_block_hashes(ns, hashes, group=0) != chunk_keys_from_block_hashes(
        make_namespace(lora_id="a"), hashes
    )
    expected = hashlib.sha256(
        b"tiered-kv/engine-chunk/v1\0" + ns.fingerprint + struct.pack("<I", 0) + struct.pack("<Q", 32) + hashes[3]
    ).digest()[:16]
    assert keys[0] == expected


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda ns: chunk_keys(ns, [1, -2, 3]), r"\[0, 2\*\*32\)"),
        (lambda ns: chunk_keys(ns, [2**32]), r"\[0, 2\*\*32\)"),
        (lambda ns: chunk_keys(ns, ["a"]), "integers"),
        (lambda ns: chunk_keys(ns, np.array([1.5, 2.5])), "integer array"),
        (lambda ns: chunk_keys(ns, np.zeros((2, 16), dtype=np.int64)), "1-D"),
        (lambda ns: chunk_keys(ns, np.array([-1] * 16)), r"\[0, 2\*\*32\)"),
        (lambda ns: chunk_keys(ns, list(range(16)), group=1), "group must be in"),
        (lambda ns: block_hashes(ns, list(range(16)), parent=b"short"), "32-byte"),
        (lambda ns: chunk_keys_from_block_hashes(ns, [b"x" * 8] * 4), "length >= 16"),
        (lambda ns: chunk_keys_from_block_hashes(ns, ["not bytes" * 4] * 4), "must be bytes"),
    ],
)
def test_bad_input_is_a_chunk_key_error(call, message: str) -> None:
    with pytest.raises(ChunkKeyError, match=message):
        call(make_namespace())

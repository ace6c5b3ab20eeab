"""Chunk keys: the content address of a chunk, bound to its namespace.

Prefix-cache contents are secret in a multi-tenant server, and a key collision would
serve one tenant's KV to another, so every hash here is SHA-256 (hardware-accelerated on
current CPUs) and keys keep 128 bits. The spec, version 1, is ``docs/keys.md``; the test
suite pins it with fixed vectors.

Two sources of keys:

* :func:`chunk_keys` — from token ids: chained prefix hashes per GPU block, seeded by
  the namespace fingerprint, and one key per full chunk from the hash of its last block.
* :func:`chunk_keys_from_block_hashes` — from the engine's own block hashes (bytes): a
  chunk's key is derived from the hash of its last block, the KV group index and the
  namespace fingerprint.

Only full chunks get keys; a trailing partial chunk is never stored.
"""

from __future__ import annotations

import array
import hashlib
import struct
from collections.abc import Sequence

import numpy as np

from tiered_kv.checks import is_int_at_least
from tiered_kv.errors import ChunkKeyError
from tiered_kv.namespace import Namespace

KEY_BYTES = 16
BLOCK_HASH_BYTES = 32

_ROOT_DOMAIN = b"tiered-kv/blocks/v1\0"
_CHUNK_DOMAIN = b"tiered-kv/chunk/v1\0"
_ENGINE_CHUNK_DOMAIN = b"tiered-kv/engine-chunk/v1\0"

#: A chunk key: 16 bytes.
ChunkKey = bytes

TokenIds = Sequence[int] | np.ndarray


def _token_bytes(tokens: TokenIds) -> bytes:
    """Token ids as little-endian uint32, rejecting ids outside ``[0, 2**32)``."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ChunkKeyError(f"token ids must be a 1-D integer array, got {tokens.dtype}{list(tokens.shape)}")
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= 2**32):
            raise ChunkKeyError("token ids must lie in [0, 2**32)")
        return tokens.astype("<u4", copy=False).tobytes()
    try:
        packed = array.array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise ChunkKeyError(f"token ids must be integers in [0, 2**32): {exc}") from exc
    if packed.itemsize != 4:  # pragma: no cover - every supported platform has a 4-byte unsigned int
        raise ChunkKeyError("this platform has no 4-byte unsigned int array")
    if struct.pack("=I", 1) != struct.pack("<I", 1):  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return packed.tobytes()


def root_hash(namespace: Namespace) -> bytes:
    """The parent of a sequence's first block: the chain's seed, bound to the namespace."""
    return hashlib.sha256(_ROOT_DOMAIN + namespace.fingerprint).digest()


def block_hashes(namespace: Namespace, tokens: TokenIds, *, parent: bytes | None = None) -> list[bytes]:
    """Chained 32-byte hashes of every full GPU block of ``tokens``.

    ``h[i] = SHA-256(h[i−1] ‖ tokens of block i as uint32 LE)``, with ``h[−1]`` the
    namespace's :func:`root_hash`, or ``parent`` to extend an existing chain.
    """
    prev = root_hash(namespace) if parent is None else parent
    if len(prev) != BLOCK_HASH_BYTES:
        raise ChunkKeyError(f"parent must be a {BLOCK_HASH_BYTES}-byte block hash, got {len(prev)} bytes")
    data = memoryview(_token_bytes(tokens))
    step = namespace.geometry.block_size * 4
    sha256 = hashlib.sha256
    hashes: list[bytes] = []
    for start in range(0, len(data) - step + 1, step):
        h = sha256(prev)
        h.update(data[start : start + step])
        prev = h.digest()
        hashes.append(prev)
    return hashes


def chunk_keys(namespace: Namespace, tokens: TokenIds, *, group: int = 0) -> list[ChunkKey]:
    """One 16-byte key per full chunk of ``tokens`` for KV group ``group``."""
    return chunk_keys_from_chain(namespace, block_hashes(namespace, tokens), group=group)


def _check_group(namespace: Namespace, group: int) -> bytes:
    if not is_int_at_least(group, 0) or group >= len(namespace.geometry.groups):
        raise ChunkKeyError(f"group must be in [0, {len(namespace.geometry.groups)}), got {group!r}")
    return struct.pack("<I", group)


def chunk_keys_from_chain(namespace: Namespace, hashes: Sequence[bytes], *, group: int = 0) -> list[ChunkKey]:
    """Keys of the full chunks covered by this library's chained block hashes."""
    tag = _CHUNK_DOMAIN + _check_group(namespace, group)
    per_chunk = namespace.geometry.blocks_per_chunk
    return [
        hashlib.sha256(tag + hashes[last]).digest()[:KEY_BYTES] for last in range(per_chunk - 1, len(hashes), per_chunk)
    ]


def chunk_keys_from_block_hashes(namespace: Namespace, hashes: Sequence[bytes], *, group: int = 0) -> list[ChunkKey]:
    """Keys of the full chunks covered by the engine's own per-block hashes.

    The engine's hash of a chunk's last block already chains over the whole prefix; the
    key binds it to this namespace and KV group. Engine hashes must be at least 16 bytes
    (a shorter hash cannot keep tenants apart).
    """
    tag = _ENGINE_CHUNK_DOMAIN + namespace.fingerprint + _check_group(namespace, group)
    per_chunk = namespace.geometry.blocks_per_chunk
    keys: list[ChunkKey] = []
    for last in range(per_chunk - 1, len(hashes), per_chunk):
        h = hashes[last]
        if not isinstance(h, bytes) or len(h) < KEY_BYTES:
            raise ChunkKeyError(f"engine block hash {last} must be bytes of length >= {KEY_BYTES}")
        keys.append(hashlib.sha256(tag + struct.pack("<Q", len(h)) + h).digest()[:KEY_BYTES])
    return keys

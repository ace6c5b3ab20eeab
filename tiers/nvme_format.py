"""The nvme tier's on-disk format: the slot header and the manifest.

Every slot starts with a 4 KiB header block (so the payload stays aligned for
``O_DIRECT``); the header's fields fit in its first 512-byte sector, which a disk writes
whole. It binds the payload to everything a reader must agree on — format version,
namespace fingerprint, slot index (a misdirected write is caught), chunk key, payload
length — plus an xxh3-128 checksum of the payload and an xxh3-64 checksum of the header
itself. A reader that disagrees with any field gets :class:`CorruptChunk`, never bytes.

The manifest lists which slot holds which key. It is a hint for warm restart, not a
source of truth: every entry is verified against its slot before it is served again.
"""

from __future__ import annotations

import struct

import msgspec
import xxhash

from tiered_kv.errors import CorruptChunk

FORMAT_VERSION = 1
MAGIC = b"TKVSLOT\0"
#: Bytes reserved for the header in front of each payload.
HEADER_BYTES = 4096
#: The longest chunk key a header holds.
MAX_KEY_BYTES = 256

# magic, version, key length, reserved, slot, payload length, namespace fingerprint, payload checksum
_FIXED = struct.Struct("<8sHHIQQ32s16s")
_CHECK = struct.Struct("<Q")
_TIER = "nvme"


def payload_checksum(payload: memoryview) -> bytes:
    """xxh3-128 of the payload (tens of GB/s, so verifying never limits disk throughput)."""
    return bytes(xxhash.xxh3_128_digest(payload))


def pack_header(*, fingerprint: bytes, slot: int, key: bytes, length: int, checksum: bytes) -> bytes:
    """The header for a payload of ``length`` bytes with ``checksum``, written at ``slot``."""
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"a chunk key of {len(key)} bytes is longer than {MAX_KEY_BYTES}")
    body = _FIXED.pack(MAGIC, FORMAT_VERSION, len(key), 0, slot, length, fingerprint, checksum) + key
    return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))


def read_header(raw: bytes | memoryview, *, fingerprint: bytes, slot: int) -> tuple[bytes, int, bytes]:
    """``(key, payload length, payload checksum)`` of a header, after checking that it is
    intact, of this format, of this namespace and written for this slot."""
    magic, version, key_len, _, at_slot, length, at_fingerprint, checksum = _FIXED.unpack_from(raw)
    if magic != MAGIC:
        raise CorruptChunk(f"slot {slot} holds no chunk header", tier=_TIER)
    if key_len > MAX_KEY_BYTES:
        raise CorruptChunk(f"slot {slot}: header is damaged", tier=_TIER)
    end = _FIXED.size + key_len
    (stored,) = _CHECK.unpack_from(raw, end)
    if stored != xxhash.xxh3_64_intdigest(bytes(raw[:end])):
        raise CorruptChunk(f"slot {slot}: header checksum mismatch", tier=_TIER)
    if version != FORMAT_VERSION:
        raise CorruptChunk(f"slot {slot}: format version {version}, expected {FORMAT_VERSION}", tier=_TIER)
    if at_fingerprint != fingerprint:
        raise CorruptChunk(f"slot {slot}: chunk of another namespace", tier=_TIER)
    if at_slot != slot:
        raise CorruptChunk(f"slot {slot}: header written for slot {at_slot}", tier=_TIER)
    return bytes(raw[_FIXED.size : end]), length, checksum


class Manifest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which slot holds which chunk key, for one namespace and KV group."""

    format: int = FORMAT_VERSION
    fingerprint: bytes
    group: int
    slot_bytes: int
    #: slot index → chunk key
    chunks: dict[int, bytes]


def encode_manifest(manifest: Manifest) -> bytes:
    return msgspec.msgpack.encode(manifest)


def decode_manifest(data: bytes) -> Manifest:
    """The manifest in ``data``; ``msgspec.DecodeError`` (a ``ValueError``) when it is not one."""
    return msgspec.msgpack.decode(data, type=Manifest)

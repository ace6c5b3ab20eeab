"""The remote tier's on-server format: key names and the value header.

A value is a header followed by the chunk's payload. The header binds the payload to
everything a reader must agree on — format version, namespace fingerprint, KV group,
chunk key, payload length — plus the payload's xxh3-128 checksum (the nvme tier's choice,
:func:`tiered_kv.tiers.nvme_format.payload_checksum`) and an xxh3-64 checksum of the header
itself. Anyone who can write to the server can therefore make a chunk miss, never make a
reader accept other bytes: a value that disagrees with any field is refused.

Key names are ``<prefix>:<fingerprint>:g<group>:<chunk key>`` (fingerprint and chunk key
in hex), so two namespaces, or two groups of one namespace, never share a name, and
everything one deployment stores lies under its prefix.
"""

from __future__ import annotations

import struct

import xxhash

from tiered_kv.errors import CorruptChunk
from tiered_kv.tiers.nvme_format import MAX_KEY_BYTES

FORMAT_VERSION = 1
MAGIC = b"TKVREMOT"
_TIER = "remote"

# magic, version, key length, group, payload length, namespace fingerprint, payload checksum
_FIXED = struct.Struct("<8sHHIQ32s16s")
_CHECK = struct.Struct("<Q")


def payload_digest() -> xxhash.xxh3_128:
    """A streaming :func:`~tiered_kv.tiers.nvme_format.payload_checksum`: fed the payload
    piece by piece, its ``digest()`` is the same checksum."""
    return xxhash.xxh3_128()


def header_bytes(key_len: int) -> int:
    """Bytes of the header in front of a payload whose chunk key has ``key_len`` bytes."""
    return _FIXED.size + key_len + _CHECK.size


def key_name(prefix: bytes, fingerprint_hex: str, group: int, key: bytes) -> bytes:
    """The server key of chunk ``key`` of KV group ``group`` of a namespace."""
    return b"%s:%s:g%d:%s" % (prefix, fingerprint_hex.encode("ascii"), group, key.hex().encode("ascii"))


def namespace_pattern(prefix: bytes, fingerprint_hex: str | None = None) -> bytes:
    """A ``SCAN MATCH`` pattern for every key under ``prefix``, or one namespace's keys."""
    escaped = bytes(b for c in prefix for b in (b"\\%c" % c if c in b"*?[]\\" else bytes([c])))
    return escaped + (b":" + fingerprint_hex.encode("ascii") if fingerprint_hex else b"") + b":*"


def pack_header(*, fingerprint: bytes, group: int, key: bytes, length: int, checksum: bytes) -> bytes:
    """The header for a payload of ``length`` bytes with ``checksum``."""
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"a chunk key of {len(key)} bytes is longer than {MAX_KEY_BYTES}")
    body = _FIXED.pack(MAGIC, FORMAT_VERSION, len(key), group, length, fingerprint, checksum) + key
    return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))


def read_header(
    raw: bytes | bytearray | memoryview, *, fingerprint: bytes, group: int, key: bytes
) -> tuple[int, bytes]:
    """``(payload length, payload checksum)`` of a header, after checking that it is intact,
    of this format, and written for this namespace, group and chunk key."""
    if len(raw) != header_bytes(len(key)):
        raise CorruptChunk("value holds no chunk header", tier=_TIER)
    magic, version, key_len, at_group, length, at_fingerprint, checksum = _FIXED.unpack_from(raw)
    if magic != MAGIC or key_len != len(key):
        raise CorruptChunk("value holds no chunk header for a key of this length", tier=_TIER)
    end = _FIXED.size + key_len
    (stored,) = _CHECK.unpack_from(raw, end)
    if stored != xxhash.xxh3_64_intdigest(raw[:end]):
        raise CorruptChunk("header checksum mismatch", tier=_TIER)
    if version != FORMAT_VERSION:
        raise CorruptChunk(f"format version {version}, expected {FORMAT_VERSION}", tier=_TIER)
    if at_fingerprint != fingerprint:
        raise CorruptChunk("chunk of another namespace", tier=_TIER)
    if at_group != group or raw[_FIXED.size : end] != key:
        raise CorruptChunk("value holds another chunk", tier=_TIER)
    return length, checksum

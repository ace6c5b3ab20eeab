"""One small exception tree for everything tiered-kv raises on purpose.

Native errors (``OSError``, CUDA, msgspec) are wrapped at the boundary where they occur
with ``raise ... from exc``. A cache miss is a return value, never an exception, and
``asyncio.CancelledError`` is never caught and turned into one of these.
"""

from __future__ import annotations


class TieredKVError(Exception):
    """Base of every error tiered-kv raises on purpose."""


class ConfigError(TieredKVError, ValueError):
    """A configuration value is invalid; names the field and, when loaded, the file."""

    def __init__(self, message: str, *, field: str | None = None, source: str | None = None):
        self.field = field
        self.source = source
        where = " ".join(part for part in (source and f"{source}:", field and f"[{field}]") if part)
        super().__init__(f"{where} {message}" if where else message)


class GeometryError(ConfigError):
    """The KV geometry (sizes, dtype, attention groups) is not one tiered-kv can store."""


class NamespaceError(ConfigError):
    """A namespace field is invalid."""


class SpanError(TieredKVError, ValueError):
    """A sliding-window block span is out of bounds or its geometry is invalid.

    The manager turns this into a miss for the load that carried it; the engine keeps
    running.
    """


class BlockTableError(TieredKVError, ValueError):
    """A block table names a GPU block the registered KV cache does not have."""


class ChunkKeyError(TieredKVError, ValueError):
    """Token ids or engine block hashes cannot be turned into chunk keys."""


class RequestError(TieredKVError, ValueError):
    """A request id is not a string."""


class UnknownPluginError(TieredKVError, LookupError):
    """No tier driver or cache policy is registered under the requested name."""

    def __init__(self, kind: str, name: str, available: list[str]):
        self.kind = kind
        self.name = name
        self.available = available
        listing = ", ".join(available) if available else "none"
        super().__init__(f"unknown {kind} {name!r}; available: {listing}")


class TierError(TieredKVError):
    """A tier driver could not move bytes; the chunk involved is a miss, never served."""

    def __init__(self, message: str, *, tier: str):
        self.tier = tier
        #: The message without the tier's name in front.
        self.detail = message
        super().__init__(f"{tier}: {message}")


class TierIOError(TierError):
    """The medium failed (an ``OSError`` or a CUDA error, kept as ``__cause__``)."""


class TierFullError(TierError):
    """The medium has no room left (for example ``ENOSPC`` on the nvme tier)."""


class CorruptChunk(TierError):
    """Stored bytes failed verification (header, namespace, key, length or checksum)."""


class CorruptStore(TierError):
    """A store's record of what it holds contradicts the namespace it is opened for; only
    tampering gets it there, because a store's directory is named after its namespace."""


class UnsafeStore(TierError):
    """A path of an nvme store could put its files in someone else's hands: a symbolic
    link, not a regular file or directory, owned by another user, or writable by group or
    others. The store is refused; ``path`` and ``reason`` say which and why."""

    def __init__(self, path: str, reason: str, *, tier: str):
        self.path = path
        self.reason = reason
        super().__init__(f"{path} {reason}: refused", tier=tier)


class TierClosedError(TierError):
    """The driver was used after :meth:`close`."""


class PolicyError(TieredKVError, ValueError):
    """A cache policy was used against its contract (unknown key, duplicate insert)."""


class BusyError(TieredKVError):
    """A ``*_nowait`` call would have had to wait for room in a bounded queue."""


class TraceFormatError(TieredKVError, ValueError):
    """A request trace file is not in the format its reader expects (one line)."""

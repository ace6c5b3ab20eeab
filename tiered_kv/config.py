"""Configuration: frozen msgspec Structs, loaded from TOML or JSON.

Unknown fields are rejected, and every error names the bad field and the file it came
from, so a typo in a deployment's config fails at start-up instead of silently using a
default. A file larger than ``MAX_CONFIG_BYTES`` is not a config: at most that much of
it is read.
"""

from __future__ import annotations

import asyncio
import codecs
import enum
import os
import re
from pathlib import Path
from typing import Any, TypeVar

import aiofiles
import msgspec

from tiered_kv.checks import is_int_at_least
from tiered_kv.errors import ConfigError
from tiered_kv.registry import ADMISSION_FILTERS, POLICIES

T = TypeVar("T")

#: The largest config file read (a config is a few hundred bytes; ``/dev/zero`` is endless).
MAX_CONFIG_BYTES = 1 << 20


def _check_field_types(record: msgspec.Struct) -> None:
    """Give a config built in Python the type checks a decoded one gets: each field converted
    to its declared type (a write policy given as its string becomes the enum, a path its
    string), or a :class:`ConfigError` naming the field."""
    for field in msgspec.structs.fields(record):
        value = getattr(record, field.name)
        if field.type is str and isinstance(value, os.PathLike):
            value = os.fspath(value)
        try:
            converted = msgspec.convert(value, field.type)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"{exc}, got {value!r}", field=field.name) from None
        if converted is not getattr(record, field.name):
            msgspec.structs.force_setattr(record, field.name, converted)


def _require_positive(field: str, value: Any) -> None:
    if not is_int_at_least(value, 1):
        raise ConfigError(f"must be a positive integer, got {value!r}", field=field)


#: The tiers a quota can name.
TIER_NAMES = ("cpu", "nvme")


class WritePolicy(enum.StrEnum):
    """When a chunk stored in the cpu tier is also written to nvme and to the remote tier
    (each that is configured), from its cpu slot."""

    #: Every stored chunk is written in the background (and a chunk loaded from the
    #: remote tier is written to nvme).
    WRITE_THROUGH = "write_through"
    #: A chunk is written when the cpu tier evicts it, before its slot is reused.
    WRITE_BACK = "write_back"
    #: A chunk is written once it has been hit ``selective_hits`` times.
    SELECTIVE = "selective"


class CpuTierConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    capacity_bytes: int

    def __post_init__(self) -> None:
        _check_field_types(self)
        _require_positive("capacity_bytes", self.capacity_bytes)


class NvmeTierConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    #: Root directory; each namespace gets an owner-only subdirectory below it.
    root: str
    #: Bytes of chunk payload. On disk each slot also takes a 4 KiB header and rounds up to
    #: whole 4 KiB pages: leave that room (about 4 KiB per chunk) on the filesystem.
    capacity_bytes: int
    #: I/Os in flight per slot file (the nvme driver's threads), and nvme calls the
    #: manager lets run at once over all of them (loads first).
    io_depth: int = 8

    def __post_init__(self) -> None:
        _check_field_types(self)
        if not self.root:
            raise ConfigError("must not be empty", field="root")
        _require_positive("capacity_bytes", self.capacity_bytes)
        _require_positive("io_depth", self.io_depth)


class RemoteTierConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A Valkey/Redis deployment shared by engines: one server (``url``) or a cluster.

    The configuration holds no secret: the password comes from the environment variable
    ``password_env`` or the file ``password_file``, read when the tier opens.
    """

    #: ``redis://host:port`` (or ``rediss://`` for TLS) of one server.
    url: str | None = None
    #: ``host:port`` of some nodes of a cluster; the rest of the cluster is discovered.
    cluster_nodes: list[str] = msgspec.field(default_factory=list)
    #: Every key lies under ``<prefix>:``, followed by the namespace fingerprint.
    prefix: str = "tkv"
    #: Connections per node, and I/Os in flight.
    io_depth: int = 8
    #: Limit on each socket operation; a server slower than that is a miss.
    timeout_s: float = 2.0
    connect_timeout_s: float = 1.0
    #: After a failed connect, the node is not tried again for this long (doubling up to
    #: ``backoff_max_s``); its chunks are misses meanwhile.
    backoff_s: float = 0.1
    backoff_max_s: float = 5.0
    #: TLS with the system's certificate authorities, or ``tls_ca_file``'s.
    tls: bool = False
    tls_ca_file: str | None = None
    username: str | None = None
    password_env: str | None = None
    password_file: str | None = None
    #: Chunk keys per KV group the residency hint remembers as likely on the server (and,
    #: as many, as known absent): about 150 bytes of host memory each.
    hint_chunks: int = 65536
    #: How long a key the server did not have is not asked about again.
    absent_ttl_s: float = 5.0
    #: Keys a lookup that stops at an unknown key queues for an ``EXISTS`` probe: it and
    #: the unknown keys right after it (another engine may have stored the whole prefix).
    probe_ahead: int = 16
    #: Keys waiting to be probed, at most (the oldest are dropped), and keys per ``EXISTS`` batch.
    max_probes: int = 4096
    probe_batch: int = 256

    def __post_init__(self) -> None:
        _check_field_types(self)
        if (self.url is None) == (not self.cluster_nodes):
            raise ConfigError("give either url or cluster_nodes", field="url")
        if self.url is not None:
            if "@" in self.url:  # checked first: the other messages repeat the URL
                raise ConfigError(
                    "must hold no credentials: use username and password_env or password_file", field="url"
                )
            scheme, sep, rest = self.url.partition("://")
            if not sep or scheme not in ("redis", "rediss") or "/" in rest or _host_port(rest, 6379) is None:
                raise ConfigError(f"expected redis://host:port or rediss://host:port, got {self.url!r}", field="url")
        for node in self.cluster_nodes:
            if _host_port(node, None) is None:
                raise ConfigError(f"expected host:port, got {node!r}", field="cluster_nodes")
        if not self.prefix or any(c in self.prefix for c in " \r\n"):
            raise ConfigError("must be non-empty, without spaces or line breaks", field="prefix")
        for name in ("io_depth", "hint_chunks", "probe_ahead", "max_probes", "probe_batch"):
            _require_positive(name, getattr(self, name))
        for name in ("timeout_s", "connect_timeout_s", "backoff_s", "backoff_max_s", "absent_ttl_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"must be a positive number of seconds, got {value!r}", field=name)
        if self.password_env is not None and self.password_file is not None:
            raise ConfigError("give password_env or password_file, not both", field="password_env")

    @property
    def uses_tls(self) -> bool:
        return self.tls or (self.url or "").startswith("rediss://")

    def addresses(self) -> list[tuple[str, int]]:
        """``(host, port)`` of the server, or of the cluster nodes given."""
        if self.url is not None:
            given = [_host_port(self.url.partition("://")[2], 6379)]
        else:
            given = [_host_port(node, None) for node in self.cluster_nodes]
        addresses = [address for address in given if address is not None]
        assert len(addresses) == len(given), "checked when the config was made"
        return addresses


def _host_port(text: str, default_port: int | None) -> tuple[str, int] | None:
    """``host:port``, ``[v6 address]:port`` or, where ``default_port`` is given, the host
    alone, as ``(host, port)``; ``None`` when ``text`` is none of these or the port is not
    1 to 65535."""
    if text.startswith("["):
        host, closed, after = text[1:].partition("]")
        if not closed or (after and not after.startswith(":")):
            return None
        port = after[1:] if after else None
    else:
        host, sep, port_or_host = text.rpartition(":")
        host, port = (host, port_or_host) if sep else (port_or_host, None)
    if not host:
        return None
    if port is None:
        return None if default_port is None else (host, default_port)
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        return None
    return host, int(port)


class NamespacePolicyConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a model's chunks are kept: eviction policy, quotas, write policy, tier budgets.

    A model's tenants (namespaces that differ only in LoRA adapter or cache salt) share
    its tiers; each gets its own instance of ``policy`` and its own ``quota_chunks``.
    """

    #: A name registered in the ``tiered_kv.policies`` group.
    policy: str = "lru"
    #: Chunks per tier that each tenant keeps even under other tenants' pressure.
    quota_chunks: dict[str, int] = msgspec.field(default_factory=dict)
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    selective_hits: int = 2
    #: An admission filter registered in ``tiered_kv.admission`` (e.g. ``seen_k``): a
    #: chunk is stored only once the filter admits it. ``None`` stores every chunk.
    admission: str | None = None
    #: Sightings ``admission`` waits for before it admits a chunk.
    admission_k: int = 2
    #: Bytes of each tier this namespace gets when it is registered; ``None`` takes all
    #: that earlier registrations left.
    cpu_bytes: int | None = None
    nvme_bytes: int | None = None

    def __post_init__(self) -> None:
        _check_field_types(self)
        if not self.policy:
            raise ConfigError("must not be empty", field="policy")
        for tier, quota in self.quota_chunks.items():
            if tier not in TIER_NAMES:
                raise ConfigError(
                    f"unknown tier {tier!r}; tiers: {', '.join(TIER_NAMES)}", field=f"quota_chunks.{tier}"
                )
            _require_positive(f"quota_chunks.{tier}", quota)
        _require_positive("selective_hits", self.selective_hits)
        _require_positive("admission_k", self.admission_k)
        if self.admission == "":
            raise ConfigError("must not be empty (leave it out to store every chunk)", field="admission")
        for name in ("cpu_bytes", "nvme_bytes"):
            if getattr(self, name) is not None:
                _require_positive(name, getattr(self, name))


class TieredKVConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Tiers and per-namespace policies of one :class:`TieredKV`."""

    cpu: CpuTierConfig
    nvme: NvmeTierConfig | None = None
    remote: RemoteTierConfig | None = None
    default_policy: NamespacePolicyConfig = msgspec.field(default_factory=NamespacePolicyConfig)
    #: Per-namespace overrides, keyed by model id.
    namespaces: dict[str, NamespacePolicyConfig] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_field_types(self)

    def policy_for(self, model_id: str) -> NamespacePolicyConfig:
        return self.namespaces.get(model_id, self.default_policy)


_AT = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_UNKNOWN = re.compile(r"unknown field `(?P<name>[^`]+)`")


def _field_path(exc: msgspec.ValidationError) -> tuple[str, str | None]:
    """The message and dotted field path of a msgspec validation error.

    msgspec reports ``"... - at `$.a.b`"``; a field rejected by a ``__post_init__`` check
    arrives as the ConfigError it raised, which names the field inside that record.
    """
    message = str(exc)
    match = _AT.search(message)
    parts = [match.group("path").lstrip(".")] if match else []
    message = message[: match.start()] if match else message
    inner = exc.__cause__
    unknown = _UNKNOWN.search(message)
    if isinstance(inner, ConfigError):
        parts.append(inner.field or "")
        message = inner.args[0].removeprefix(f"[{inner.field}] ")
    elif unknown:
        parts.append(unknown.group("name"))
    path = ".".join(part for part in parts if part)
    return message, path or None


def load_config(path: str | Path, type: type[T] = TieredKVConfig) -> T:  # type: ignore[assignment]
    """Load ``type`` from a ``.toml`` or ``.json`` file, naming the bad field on error."""
    try:
        with Path(path).open("rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", source=str(path)) from exc
    config = _decode(data, _suffix(path), str(path), type)
    if isinstance(config, TieredKVConfig):
        _check_plugin_names(config, str(path))
    return config


async def load_config_async(path: str | Path, type: type[T] = TieredKVConfig) -> T:  # type: ignore[assignment]
    """:func:`load_config` for a server's event loop: nothing that reads files runs on it, so
    a slow or network filesystem never holds the loop."""
    try:
        async with aiofiles.open(path, "rb") as file:
            data = await file.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", source=str(path)) from exc
    config = _decode(data, _suffix(path), str(path), type)
    if isinstance(config, TieredKVConfig):
        # The registries read the installed distributions' entry points: files too.
        await asyncio.to_thread(_check_plugin_names, config, str(path))
    return config


def _suffix(path: str | Path) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in (".toml", ".json"):
        raise ConfigError(f"unsupported config format {suffix!r}; use .toml or .json", source=str(path))
    return suffix


def _decode(data: bytes, suffix: str, source: str, type: type[T]) -> T:
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"larger than {MAX_CONFIG_BYTES:,} bytes: not a config file", source=source)
    decode = msgspec.toml.decode if suffix == ".toml" else msgspec.json.decode
    try:
        config = decode(data.removeprefix(codecs.BOM_UTF8), type=type)  # an editor's byte-order mark
    except msgspec.ValidationError as exc:
        message, field = _field_path(exc)
        raise ConfigError(message, field=field, source=source) from exc
    except msgspec.DecodeError as exc:
        raise ConfigError(f"not valid {suffix[1:].upper()}: {exc}", source=source) from exc
    except RecursionError as exc:  # the decoders recurse per level of arrays and tables
        raise ConfigError("nested too deeply to read: not a config file", source=source) from exc
    return config


def _check_plugin_names(config: TieredKVConfig, source: str) -> None:
    """Policies and admission filters must be registered: a typo fails at start-up."""
    policies, filters = POLICIES.names(), ADMISSION_FILTERS.names()
    named = [("default_policy", config.default_policy)] + [
        (f"namespaces.{model}", policy) for model, policy in config.namespaces.items()
    ]
    for where, policy in named:
        if policy.policy not in policies:
            raise ConfigError(
                f"unknown policy {policy.policy!r}; available: {', '.join(policies)}",
                field=f"{where}.policy",
                source=source,
            )
        if policy.admission is not None and policy.admission not in filters:
            raise ConfigError(
                f"unknown admission filter {policy.admission!r}; available: {', '.join(filters)}",
                field=f"{where}.admission",
                source=source,
            )

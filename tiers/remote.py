"""The remote tier: chunks in a Valkey/Redis deployment that many engines share.

The store is addressed by chunk key alone (ops carry ``key``, no slot): a chunk of KV
group ``g`` of a namespace lives under ``<prefix>:<fingerprint>:g<g>:<key>`` (see
:mod:`tiered_kv.tiers.remote_format`), as a header and the payload. Every read verifies
header and checksum; a value that fails is a miss, and the driver deletes it. The server
may evict or lose any chunk at any time, so a vanished key is an ordinary miss, and the
driver keeps no index: what is likely there is the core's residency hint's business.

I/O runs on ``io_depth`` driver threads, each with its own connection per node
(:mod:`tiered_kv.tiers.remote_nodes`); a batch is cut into ``io_depth`` runs, each run
pipelined on its connection, and values move between sockets and host buffers without
copies (:mod:`tiered_kv.tiers.remote_resp`). A failure — connection refused, per-I/O
timeout, server gone mid-transfer, ``OOM`` — fails the ops it touched and no others;
cluster ``MOVED``/``ASK`` replies are followed. Cancelling a call shuts its connections
down, so the call returns as soon as its threads let go of the buffers.

:meth:`RemoteTier.read_each` and :meth:`RemoteTier.write_each` report per op; ``read``
and ``write`` (the :class:`~tiered_kv.interfaces.TierDriver` protocol) raise for the
first op that did not succeed.
"""

from __future__ import annotations

import asyncio
import enum
import os
import ssl
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from tiered_kv.config import RemoteTierConfig
from tiered_kv.driver_base import DriverBase
from tiered_kv.errors import ConfigError, CorruptChunk, TierFullError, TierIOError
from tiered_kv.interfaces import RemoteTierStats, RemoteUsage, TransferOp
from tiered_kv.keys import ChunkKey
from tiered_kv.log import get_logger
from tiered_kv.namespace import Namespace
from tiered_kv.tiers._driver import (
    WorkerPool,
    bytes_of,
    check_buffer,
    in_threads,
    settle,
    shutdown,
    split,
    worker_pool_off_loop,
)
from tiered_kv.tiers.nvme_format import MAX_KEY_BYTES, payload_checksum
from tiered_kv.tiers.remote_format import (
    header_bytes,
    key_name,
    namespace_pattern,
    pack_header,
    payload_digest,
    read_header,
)
from tiered_kv.tiers.remote_nodes import Address, Nodes, NodeSettings
from tiered_kv.tiers.remote_resp import ProtocolError, RespConnection, RespError, command, set_prefix

log = get_logger("remote")

#: Rounds of a batch: the first, and up to this many more after ``MOVED``/``ASK`` replies.
MAX_REDIRECTS = 3
_ASKING = command("ASKING")
_CRLF = b"\r\n"
#: Keys a ``SCAN`` step asks for.
_SCAN_COUNT = 1000
#: Requests of a pipeline are sent once they add up to this many bytes (or at its end).
_SEND_BYTES = 1 << 20


class Outcome(enum.Enum):
    OK = "ok"
    #: The server holds no such key (never written, evicted, lost in a restart).
    ABSENT = "absent"
    #: The value failed verification; it is deleted.
    CORRUPT = "corrupt"
    #: The server refused a write for lack of memory (``OOM``).
    FULL = "full"
    #: The I/O failed: unreachable node, timeout, connection lost, unexpected reply.
    FAILED = "failed"


class _Item:
    __slots__ = ("fingerprint", "name", "op")

    def __init__(self, name: bytes, op: TransferOp | None, fingerprint: bytes) -> None:
        self.name = name
        self.op = op
        #: The namespace the value belongs to (bound in its name and its header).
        self.fingerprint = fingerprint


class _Call:
    """The connections one driver call is using, so that cancelling it can cut them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: set[RespConnection] = set()
        self.aborted = False

    def use(self, conn: RespConnection) -> None:
        with self._lock:
            if self.aborted:
                raise ConnectionAbortedError("the call was cancelled")
            self._active.add(conn)

    def done(self, conn: RespConnection) -> None:
        with self._lock:
            self._active.discard(conn)

    def abort(self) -> None:
        with self._lock:
            self.aborted = True
            active = list(self._active)
        for conn in active:
            conn.abort()


class _Verb(Protocol):
    """One command applied to each item of a run: what to send, how to read its reply."""

    def request(self, item: _Item) -> list[bytes | memoryview]: ...

    def response(self, conn: RespConnection, item: _Item) -> Outcome | RespError: ...


class _Get:
    def __init__(self, group: int) -> None:
        self.group = group

    def request(self, item: _Item) -> list[bytes | memoryview]:
        return [command("GET", item.name)]

    def response(self, conn: RespConnection, item: _Item) -> Outcome | RespError:
        assert item.op is not None
        n = conn.read_bulk_length()
        if isinstance(n, RespError):
            return n
        if n < 0:
            return Outcome.ABSENT
        key = item.op.key
        target = bytes_of(item.op.buffer)
        size = header_bytes(len(key))
        if n != size + len(target):
            return _drop(conn, n, size + len(target))
        raw = bytearray(size)
        conn.read_into(memoryview(raw))
        try:
            length, checksum = read_header(raw, fingerprint=item.fingerprint, group=self.group, key=key)
        except CorruptChunk:
            return _drop(conn, n - size, n)
        if length != len(target):
            return _drop(conn, n - size, n)
        digest = payload_digest()
        conn.read_into(target, digest)
        conn.expect_crlf()
        return Outcome.OK if digest.digest() == checksum else Outcome.CORRUPT


class _Oversized(OSError):
    """A value far larger than the chunk it should hold: cheaper to drop the connection
    than to read it (anyone who can write the server could make reads slow otherwise)."""


def _drop(conn: RespConnection, rest: int, expected: int) -> Outcome:
    """Skip the ``rest`` of a value that failed verification; a chunk is ``expected`` bytes."""
    if rest > 2 * expected + (64 << 10):
        raise _Oversized(f"a value of {rest} bytes where a chunk has {expected}")
    conn.skip(rest)
    conn.expect_crlf()
    return Outcome.CORRUPT


class _Set:
    def __init__(self, group: int) -> None:
        self.group = group

    def request(self, item: _Item) -> list[bytes | memoryview]:
        assert item.op is not None
        payload = bytes_of(item.op.buffer)
        header = pack_header(
            fingerprint=item.fingerprint,
            group=self.group,
            key=item.op.key,
            length=len(payload),
            checksum=payload_checksum(payload),
        )
        return [set_prefix(item.name, len(header) + len(payload)), header, payload, _CRLF]

    def response(self, conn: RespConnection, item: _Item) -> Outcome | RespError:
        reply = conn.read_reply()
        if isinstance(reply, RespError):
            return reply
        return Outcome.OK if reply == b"OK" else Outcome.FAILED


class _RawSet:
    """``SET`` of the bare buffer: no header, no checksum (the client's own limit)."""

    def request(self, item: _Item) -> list[bytes | memoryview]:
        assert item.op is not None
        payload = bytes_of(item.op.buffer)
        return [set_prefix(item.name, len(payload)), payload, _CRLF]

    def response(self, conn: RespConnection, item: _Item) -> Outcome | RespError:
        reply = conn.read_reply()
        return reply if isinstance(reply, RespError) else Outcome.OK if reply == b"OK" else Outcome.FAILED


class _RawGet:
    """``GET`` into the bare buffer, verifying nothing (the client's own limit)."""

    def request(self, item: _Item) -> list[bytes | memoryview]:
        return [command("GET", item.name)]

    def response(self, conn: RespConnection, item: _Item) -> Outcome | RespError:
        assert item.op is not None
        n = conn.read_bulk_length()
        if isinstance(n, RespError) or n < 0:
            return n if isinstance(n, RespError) else Outcome.ABSENT
        target = bytes_of(item.op.buffer)
        if n != len(target):
            conn.skip(n)
            conn.expect_crlf()
            return Outcome.FAILED
        conn.read_into(target)
        conn.expect_crlf()
        return Outcome.OK


class _Small:
    """A one-key command whose integer reply says whether the key was there."""

    def __init__(self, verb: str) -> None:
        self.verb = verb

    def request(self, item: _Item) -> list[bytes | memoryview]:
        return [command(self.verb, item.name)]

    def response(self, conn: RespConnection, item: _Item) -> Outcome | RespError:
        reply = conn.read_reply()
        if isinstance(reply, RespError):
            return reply
        if not isinstance(reply, int):
            return Outcome.FAILED
        return Outcome.OK if reply > 0 else Outcome.ABSENT


_EXISTS, _UNLINK = _Small("EXISTS"), _Small("UNLINK")


def read_password(config: RemoteTierConfig) -> str | None:
    """The password the configuration points to (environment or file), or ``None``."""
    if config.password_env is not None:
        value = os.environ.get(config.password_env)
        if value is None:
            raise ConfigError(f"environment variable {config.password_env} is not set", field="password_env")
        return value
    if config.password_file is not None:
        try:
            return Path(config.password_file).read_text().rstrip("\r\n")
        except OSError as exc:
            raise ConfigError(f"cannot read the password file: {exc.strerror}", field="password_file") from exc
    return None


def _settings(config: RemoteTierConfig) -> NodeSettings:
    """How to connect: timeouts, backoff, TLS context, credentials."""
    return NodeSettings(
        timeout_s=config.timeout_s,
        connect_timeout_s=config.connect_timeout_s,
        backoff_s=config.backoff_s,
        backoff_max_s=config.backoff_max_s,
        tls=ssl.create_default_context(cafile=config.tls_ca_file) if config.uses_tls else None,
        username=config.username,
        password=read_password(config),
    )


class RemoteTier(DriverBase):
    """Chunks of one namespace's KV group on a Valkey/Redis deployment; open with :meth:`open`.

    ``slot_bytes`` bounds a chunk's payload; ``num_slots`` is the number of chunks the
    core means to track as likely resident (the server decides what it keeps).
    """

    def __init__(
        self,
        nodes: Nodes,
        namespace: Namespace,
        *,
        group: int,
        prefix: str,
        slot_bytes: int,
        num_slots: int,
        io_depth: int,
        pool: WorkerPool,
    ) -> None:
        super().__init__("remote", slot_bytes, num_slots)
        self.nodes = nodes
        self.group = group
        self.prefix = prefix
        self.io_depth = io_depth
        self.namespace = namespace
        self._prefix = prefix.encode()
        self._pool = pool
        self._get = _Get(group)
        self._set = _Set(group)
        self._lock = threading.Lock()
        self._outcomes = dict.fromkeys(Outcome, 0)
        self._redirects = 0

    @classmethod
    async def open(
        cls, config: RemoteTierConfig, namespace: Namespace, *, slot_bytes: int, num_slots: int, group: int = 0
    ) -> RemoteTier:
        """A driver for ``namespace``'s KV group ``group`` on the deployment ``config``
        names. An unreachable deployment is not an error here (it is logged): its chunks
        are misses until it answers."""
        pool = await worker_pool_off_loop("remote", config.io_depth)
        try:
            [settings] = await in_threads(pool, _settings, [(config,)])  # reads files: not on the loop
        except BaseException:
            pool.shutdown(wait=False)
            raise
        nodes = Nodes(config.addresses(), cluster=bool(config.cluster_nodes), settings=settings)
        tier = cls(
            nodes,
            namespace,
            group=group,
            prefix=config.prefix,
            slot_bytes=slot_bytes,
            num_slots=num_slots,
            io_depth=config.io_depth,
            pool=pool,
        )
        try:
            await in_threads(pool, tier._probe, [()])
        except BaseException:
            await tier.close()
            raise
        return tier

    def _probe(self) -> None:
        try:
            node = self.nodes.route(b"") if self.nodes.cluster else self.nodes.seeds[0]
            reply = self.nodes.connection(node).call("PING")
        except OSError:
            return  # logged as remote.unreachable
        log.info("remote.connected", node=f"{node[0]}:{node[1]}", cluster=self.nodes.cluster, ok=reply == b"PONG")

    # -- the driver protocol ---------------------------------------------------------------
    async def read(self, ops: Sequence[TransferOp]) -> None:
        """Read and verify every op's chunk; raise for the first op that has none."""
        _raise_first(await self._run(self._get, self._items(ops, write=False)))

    async def write(self, ops: Sequence[TransferOp]) -> None:
        """Store every op's chunk; raise for the first op the server did not take."""
        _raise_first(await self._run(self._set, self._items(ops, write=True)))

    async def read_each(self, ops: Sequence[TransferOp], *, namespace: Namespace | None = None) -> list[bool]:
        """Read every op's chunk of ``namespace`` (a tenant of the driver's namespace;
        by default that one): true where its buffer now holds the verified chunk; false
        where the server has none (absent, evicted, corrupt) or could not be read."""
        items = self._items(ops, write=False, namespace=namespace)
        return [o is Outcome.OK for o in await self._run(self._get, items)]

    async def write_each(self, ops: Sequence[TransferOp], *, namespace: Namespace | None = None) -> list[bool]:
        """Store every op's chunk as ``namespace``'s: true where the server took it."""
        items = self._items(ops, write=True, namespace=namespace)
        return [o is Outcome.OK for o in await self._run(self._set, items)]

    async def exists(self, keys: Sequence[ChunkKey], *, namespace: Namespace | None = None) -> list[bool]:
        """Whether the server holds each of ``namespace``'s keys now (false also where it
        cannot be asked)."""
        return [o is Outcome.OK for o in await self._run(_EXISTS, self._names(keys, namespace))]

    async def delete(self, keys: Sequence[ChunkKey], *, namespace: Namespace | None = None) -> None:
        """Delete ``namespace``'s keys (best effort: a key the server cannot be reached
        for stays)."""
        await self._run(_UNLINK, self._names(keys, namespace))

    async def raw(self, ops: Sequence[TransferOp], *, write: bool) -> None:
        """For benchmarks, the client's own limit: the ops' buffers as bare values (no
        header, checksum or verification) through the same threads, connections and
        pipelining as :meth:`read` and :meth:`write`. Raises for the first op that did not
        succeed; counts nothing. The values go under the keys' names, where a later
        :meth:`read` refuses them: use a driver opened (with a prefix) for this alone."""
        items = self._items(ops, write=write)
        _raise_first(await self._run(_RawSet() if write else _RawGet(), items, count=False))

    async def usage(self) -> list[RemoteUsage]:
        """Keys and value bytes under this tier's prefix, per namespace fingerprint and
        group (every namespace's, not only this driver's), by ``SCAN`` over every node."""
        self._check_open()
        return await _usage(self._pool, self.nodes, self._prefix)

    @classmethod
    async def survey(cls, config: RemoteTierConfig) -> list[RemoteUsage]:
        """:meth:`usage` of the deployment and prefix ``config`` names, without a driver
        open on it (``tiered-kv inspect --remote``)."""
        pool = WorkerPool("remote-survey", 1)  # no torch: no worker_pool
        nodes: Nodes | None = None
        try:
            [settings] = await in_threads(pool, _settings, [(config,)])  # reads files: not on the loop
            nodes = Nodes(config.addresses(), cluster=bool(config.cluster_nodes), settings=settings)
            return await _usage(pool, nodes, config.prefix.encode())
        finally:
            await shutdown(pool)
            if nodes is not None:
                nodes.close_all()

    def remote_statistics(self) -> RemoteTierStats:
        with self._lock:
            counts = dict(self._outcomes)
            redirects = self._redirects
        return RemoteTierStats(
            absent=counts[Outcome.ABSENT],
            corrupt=counts[Outcome.CORRUPT],
            full=counts[Outcome.FULL],
            failed=counts[Outcome.FAILED],
            redirects=redirects,
            connects=self.nodes.connects,
        )

    async def close(self) -> None:
        """Wait for the I/O in flight, then close every connection."""
        if self._closed:
            return
        self._closed = True
        await shutdown(self._pool)
        self.nodes.close_all()

    def __repr__(self) -> str:
        where = ",".join(f"{host}:{port}" for host, port in self.nodes.seeds)
        kind = "cluster" if self.nodes.cluster else "server"
        return f"<RemoteTier {kind} {where} prefix={self.prefix!r} g{self.group} io_depth={self.io_depth}>"

    # -- batches -----------------------------------------------------------------------------
    def _tenant(self, namespace: Namespace | None) -> Namespace:
        """``namespace``, which must share the driver's chunks' shape (a tenant of it)."""
        if namespace is None or namespace is self.namespace:
            return self.namespace
        if namespace.base.fingerprint != self.namespace.base.fingerprint:
            raise ValueError(f"namespace {namespace.model_id} is not a tenant of this tier's model runner")
        return namespace

    def _names(self, keys: Sequence[ChunkKey], namespace: Namespace | None) -> list[_Item]:
        self._check_open()
        tenant = self._tenant(namespace)
        fingerprint, hexed = tenant.fingerprint, tenant.fingerprint_hex
        return [_Item(key_name(self._prefix, hexed, self.group, key), None, fingerprint) for key in keys]

    def _items(self, ops: Sequence[TransferOp], *, write: bool, namespace: Namespace | None = None) -> list[_Item]:
        self._check_open()
        tenant = self._tenant(namespace)
        fingerprint, hexed = tenant.fingerprint, tenant.fingerprint_hex
        for op in ops:
            check_buffer(op.buffer, max_bytes=self.slot_bytes)
            if op.slot != -1 or op.blocks:
                raise ValueError("the remote tier is addressed by chunk key alone: an op names no slot or blocks")
            if not 0 < len(op.key) <= MAX_KEY_BYTES:
                raise ValueError(f"a chunk key has 1 to {MAX_KEY_BYTES} bytes, got {len(op.key)}")
        if write and len({op.key for op in ops}) != len(ops):
            raise ValueError("a batch writes the same key twice")
        return [_Item(key_name(self._prefix, hexed, self.group, op.key), op, fingerprint) for op in ops]

    async def _run(self, verb: _Verb, items: list[_Item], *, count: bool = True) -> list[Outcome]:
        """``verb`` over ``items`` on the driver threads; the outcome of each, in order."""
        if not items:
            return []
        call = _Call()
        runs = split(items, self.io_depth)
        work = asyncio.ensure_future(in_threads(self._pool, self._serve, [(call, verb, run) for run in runs]))

        def abort() -> None:
            call.abort()
            work.cancel()

        results = await settle(work, abort)
        outcomes = [outcome for run in results for outcome in run]
        if count:
            self._tally(verb, items, outcomes)
        return outcomes

    def _tally(self, verb: _Verb, items: list[_Item], outcomes: list[Outcome]) -> None:
        done = [item for item, outcome in zip(items, outcomes, strict=True) if outcome is Outcome.OK]
        failed = sum(outcome in (Outcome.CORRUPT, Outcome.FULL, Outcome.FAILED) for outcome in outcomes)
        if verb is self._get or verb is self._set:
            nbytes = sum(item.op.buffer.numel() for item in done if item.op is not None)
            self._count(read=verb is self._get, ops=len(done), nbytes=nbytes)
        self._errors += failed
        with self._lock:
            for outcome in outcomes:
                self._outcomes[outcome] += 1

    def _serve(self, call: _Call, verb: _Verb, items: Sequence[_Item]) -> list[Outcome]:
        """One run, in a driver thread: route, pipeline per node, follow redirects."""
        outcomes = [Outcome.FAILED] * len(items)
        pending = list(range(len(items)))
        asking: dict[int, Address] = {}
        for _ in range(1 + MAX_REDIRECTS):
            if not pending or call.aborted:
                break
            groups: dict[tuple[Address, bool], list[int]] = {}
            for i in pending:
                if i in asking:
                    groups.setdefault((asking.pop(i), True), []).append(i)
                    continue
                try:
                    node = self.nodes.route(items[i].name)
                except OSError:
                    continue  # stays FAILED
                groups.setdefault((node, False), []).append(i)
            pending = []
            for (node, ask), indexes in groups.items():
                replies = self._exchange(call, verb, node, ask, [items[i] for i in indexes])
                for i, reply in zip(indexes, replies, strict=True):
                    if isinstance(reply, Outcome):
                        outcomes[i] = reply
                        continue
                    redirect = reply.redirect() if self.nodes.cluster else None
                    if redirect is None:
                        outcomes[i] = Outcome.FULL if reply.kind == "OOM" else Outcome.FAILED
                        log.debug("remote.refused", node=f"{node[0]}:{node[1]}", reason=reply.kind)
                        continue
                    kind, slot, target = redirect
                    if kind == "MOVED":
                        self.nodes.moved(slot, target)
                    else:
                        asking[i] = target
                    with self._lock:
                        self._redirects += 1
                    pending.append(i)
        if verb is self._get:
            corrupt = [items[i] for i, outcome in enumerate(outcomes) if outcome is Outcome.CORRUPT]
            if corrupt and not call.aborted:
                self._serve(call, _UNLINK, corrupt)
                log.warning("remote.chunk_dropped", n_chunks=len(corrupt), reason="failed verification")
        return outcomes

    def _exchange(
        self, call: _Call, verb: _Verb, node: Address, ask: bool, items: list[_Item]
    ) -> list[Outcome | RespError]:
        """Pipeline ``verb`` for ``items`` on this thread's connection to ``node``; an
        I/O failure fails the items whose replies had not been read.

        A connection kept from earlier calls may have died in between (the server was
        restarted): when it fails before any reply, the pipeline is sent once more on a
        new connection (every verb is idempotent)."""
        replies: list[Outcome | RespError] = [Outcome.FAILED] * len(items)
        for attempt in range(2):
            try:
                conn = self.nodes.connection(node)
            except OSError:
                self.nodes.failed(node)
                return replies
            try:
                call.use(conn)
            except ConnectionAbortedError:
                return replies
            try:
                self._pipeline(conn, verb, ask, items, replies)
                return replies
            except OSError as exc:
                self.nodes.discard(conn)
                replied = any(reply is not Outcome.FAILED for reply in replies)
                if attempt == 0 and conn.uses > 1 and not replied and not call.aborted:
                    continue
                self.nodes.failed(node)
                log.warning("remote.io_failed", node=f"{node[0]}:{node[1]}", n_chunks=len(items), reason=repr(exc))
                return replies
            finally:
                call.done(conn)
        return replies

    @staticmethod
    def _pipeline(
        conn: RespConnection, verb: _Verb, ask: bool, items: list[_Item], replies: list[Outcome | RespError]
    ) -> None:
        """Send every item's request, then read every reply into ``replies``."""
        parts: list[bytes | memoryview] = []
        pending = 0
        for item in items:
            if ask:
                parts.append(_ASKING)
            request = verb.request(item)
            parts += request
            pending += sum(len(part) for part in request)
            if pending >= _SEND_BYTES:
                conn.send(parts)  # the server works on it while the next request is built
                parts, pending = [], 0
        conn.send(parts)
        for j, item in enumerate(items):
            if ask:
                conn.read_reply()  # ASKING's +OK
            try:
                replies[j] = verb.response(conn, item)
            except _Oversized:
                replies[j] = Outcome.CORRUPT  # deleted like any value that fails
                raise


async def _usage(pool: WorkerPool, nodes: Nodes, prefix: bytes) -> list[RemoteUsage]:
    call = _Call()
    work = asyncio.ensure_future(in_threads(pool, _walk, [(nodes, prefix, call)]))

    def abort() -> None:
        call.abort()
        work.cancel()

    try:
        [totals] = await settle(work, abort)
    except OSError as exc:
        raise TierIOError(f"walking the key space: {exc!r}", tier="remote") from exc
    return [
        RemoteUsage(fingerprint=fingerprint, group=group, keys=keys, bytes=nbytes)
        for (fingerprint, group), (keys, nbytes) in sorted(totals.items())
    ]


def _walk(nodes: Nodes, prefix: bytes, call: _Call) -> dict[tuple[str, int], tuple[int, int]]:
    """``(fingerprint, group) → (keys, bytes)`` under ``prefix`` over every node, in a driver thread."""
    totals: dict[tuple[str, int], tuple[int, int]] = {}
    pattern = namespace_pattern(prefix)
    for node in nodes.primaries():
        conn = nodes.connection(node)
        call.use(conn)
        try:
            cursor = b"0"
            while True:
                reply = conn.call("SCAN", cursor, "MATCH", pattern, "COUNT", _SCAN_COUNT)
                if not (isinstance(reply, list) and len(reply) == 2 and isinstance(reply[1], list)):
                    raise ProtocolError(f"SCAN answered {reply!r:.80}")
                names = [name for name in reply[1] if isinstance(name, bytes)]
                conn.send([command("STRLEN", name) for name in names])
                for name in names:
                    length = conn.read_reply()
                    where = _namespace_of(prefix, name)
                    if where is not None and isinstance(length, int) and length > 0:
                        keys, nbytes = totals.get(where, (0, 0))
                        totals[where] = (keys + 1, nbytes + length)
                cursor = reply[0] if isinstance(reply[0], bytes) else b"0"
                if cursor == b"0":
                    break
        except OSError:
            nodes.discard(conn)
            raise
        finally:
            call.done(conn)
    return totals


def _namespace_of(prefix: bytes, name: bytes) -> tuple[str, int] | None:
    """``(fingerprint, group)`` in a key name under ``prefix``, or ``None`` for another name."""
    parts = name[len(prefix) + 1 :].split(b":")
    if len(parts) != 3 or not parts[1].startswith(b"g") or not parts[1][1:].isdigit():
        return None
    return parts[0].decode("ascii", "replace"), int(parts[1][1:])


def _raise_first(outcomes: list[Outcome]) -> None:
    for outcome in outcomes:
        if outcome is Outcome.OK:
            continue
        if outcome is Outcome.FULL:
            raise TierFullError("the server is out of memory (OOM)", tier="remote")
        if outcome is Outcome.FAILED:
            raise TierIOError("the server could not be reached or failed the I/O", tier="remote")
        message = "no chunk under this key" if outcome is Outcome.ABSENT else "the value failed verification"
        raise CorruptChunk(message, tier="remote")

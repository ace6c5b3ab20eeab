"""One Redis-protocol (RESP2) connection, used from a driver thread.

The remote tier moves values of megabytes. The registry's asyncio clients copy each value
several times on the event loop thread (or hold the GIL while they do), which stalls the
loop for milliseconds per chunk (``docs/design.md`` has the measurement). This connection
is blocking and lives on a driver thread, and a chunk's bytes never pass through a Python
object: ``SET`` sends the host buffer with ``sendmsg``, ``GET`` receives the payload with
``recv_into`` straight into the host buffer, and both release the GIL. Small replies
(``+OK``, integers, errors, ``CLUSTER SLOTS``) are parsed from a read-ahead buffer.

Every socket operation has the per-I/O timeout; :meth:`RespConnection.abort` (from any
thread) shuts the socket down so that a thread blocked on it returns at once. A
connection that saw any error is closed by its owner and never reused: a reply stream
that lost its place cannot be trusted.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
from collections.abc import Sequence
from typing import Protocol, TypeAlias

_CRLF = b"\r\n"
_READ_AHEAD = 1 << 16
#: Buffers per ``sendmsg`` call (Linux's IOV_MAX is 1024).
_IOV = 512
_MAX_LINE = 1 << 16
_MAX_ARRAY_DEPTH = 8


class RespError(Exception):
    """An error reply from the server: ``-OOM ...``, ``-MOVED 3999 host:port`` ..."""

    @property
    def kind(self) -> str:
        """The error's first word: ``ERR``, ``OOM``, ``MOVED``, ``ASK``, ``WRONGPASS`` ..."""
        return str(self.args[0]).split(" ", 1)[0]

    def redirect(self) -> tuple[str, int, tuple[str, int]] | None:
        """``(kind, slot, (host, port))`` of a ``MOVED`` or ``ASK`` reply, else ``None``."""
        parts = str(self.args[0]).split(" ")
        if len(parts) != 3 or parts[0] not in ("MOVED", "ASK"):
            return None
        host, _, port = parts[2].rpartition(":")
        if not port.isdigit() or not parts[1].isdigit():
            return None
        return parts[0], int(parts[1]), (host.strip("[]"), int(port))


#: Replies as parsed: simple strings and bulk strings as bytes, integers, nil as None,
#: arrays as lists, error replies as :class:`RespError` values (not raised).
Reply: TypeAlias = "bytes | int | list[Reply] | RespError | None"


class Digest(Protocol):
    """A streaming hash (``xxhash.xxh3_128``, ``hashlib`` objects)."""

    def update(self, data: memoryview, /) -> None: ...


class ProtocolError(OSError):
    """The server sent something that is not RESP2 where a reply was due."""


def command(*args: bytes | str | int) -> bytes:
    """One command in RESP2 framing (for small arguments: they are copied)."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        raw = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    return b"".join(parts)


def set_prefix(key: bytes, value_bytes: int) -> bytes:
    """The framing of ``SET key <value>`` up to the value's first byte; ``\\r\\n`` follows it."""
    return b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, value_bytes)


class RespConnection:
    """A blocking connection to one server; not thread-safe (one thread uses it at a time)."""

    def __init__(
        self,
        address: tuple[str, int],
        *,
        timeout_s: float,
        connect_timeout_s: float,
        tls: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        self.address = address
        sock = socket.create_connection(address, timeout=connect_timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=server_hostname or address[0])
            sock.settimeout(timeout_s)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._tls = tls is not None
        self._buf = bytearray(_READ_AHEAD)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        #: Set once the connection must not be used again (aborted or closed).
        self.broken = False
        #: Exchanges this connection was handed out for (see :meth:`Nodes.connection`).
        self.uses = 0
        if password is not None:
            auth = ("AUTH", username, password) if username else ("AUTH", password)
            reply = self.call(*auth)
            if isinstance(reply, RespError):
                self.close()
                # The server's message names no secret; the command is not repeated.
                raise ConnectionRefusedError(f"authentication failed: {reply.kind}")

    # -- lifetime --------------------------------------------------------------------------
    def abort(self) -> None:
        """Make every blocked or later I/O on this connection fail at once (any thread);
        its owner then discards it."""
        self.broken = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.broken = True
        self._sock.close()

    # -- sending ---------------------------------------------------------------------------
    def send(self, parts: Sequence[bytes | memoryview]) -> None:
        """Send ``parts`` in order, without copying them."""
        if self._tls:
            for part in parts:
                self._sock.sendall(part)
            return
        pending = [memoryview(part).cast("B") for part in parts if len(part)]
        while pending:
            sent = self._sock.sendmsg(pending[:_IOV])
            while sent:
                if sent >= len(pending[0]):
                    sent -= len(pending.pop(0))
                else:
                    pending[0] = pending[0][sent:]
                    sent = 0

    def call(self, *args: bytes | str | int) -> Reply:
        """Send one command, return its reply."""
        self.send([command(*args)])
        return self.read_reply()

    # -- receiving -------------------------------------------------------------------------
    def _fill(self) -> None:
        """Receive more bytes into the read-ahead buffer (after what it holds)."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            if self._start == 0:
                raise ProtocolError("a reply line is longer than the read-ahead buffer")
            held = self._end - self._start
            self._view[:held] = self._view[self._start : self._end]
            self._start, self._end = 0, held
        got = self._sock.recv_into(self._view[self._end :])
        if not got:
            raise ConnectionResetError("the server closed the connection")
        self._end += got

    def _line(self) -> bytes:
        while True:
            at = self._buf.find(_CRLF, self._start, self._end)
            if at >= 0:
                line = bytes(self._view[self._start : at])
                self._start = at + 2
                return line
            if self._end - self._start > _MAX_LINE:
                raise ProtocolError("a reply line is too long")
            self._fill()

    def read_into(self, target: memoryview, digest: Digest | None = None) -> None:
        """Fill ``target`` with the next ``len(target)`` bytes of the stream, feeding
        ``digest`` each piece as it arrives (hashing overlaps the transfer)."""
        held = min(self._end - self._start, len(target))
        target[:held] = self._view[self._start : self._start + held]
        self._start += held
        if digest is not None and held:
            digest.update(target[:held])
        done = held
        while done < len(target):
            got = self._sock.recv_into(target[done:])
            if not got:
                raise ConnectionResetError("the server closed the connection")
            if digest is not None:
                digest.update(target[done : done + got])
            done += got

    def skip(self, n: int) -> None:
        """Drop the next ``n`` bytes of the stream."""
        scratch = memoryview(bytearray(min(n, _READ_AHEAD))) if n > self._end - self._start else None
        while n:
            held = min(self._end - self._start, n)
            if held:
                self._start += held
                n -= held
            elif scratch is not None:
                got = self._sock.recv_into(scratch[: min(n, len(scratch))])
                if not got:
                    raise ConnectionResetError("the server closed the connection")
                n -= got

    def expect_crlf(self) -> None:
        end = bytearray(2)
        self.read_into(memoryview(end))
        if end != _CRLF:
            raise ProtocolError("a bulk reply does not end in CRLF")

    def read_bulk_length(self) -> int | RespError:
        """The length of the bulk reply that follows (its bytes stay in the stream), ``-1``
        for nil, or the error reply in its place."""
        line = self._line()
        if line[:1] == b"$":
            return _int(line)
        if line[:1] == b"-":
            return RespError(line[1:].decode("utf-8", "replace"))
        raise ProtocolError(f"expected a bulk reply, got {line[:1]!r}")

    def read_reply(self, depth: int = 0) -> Reply:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b"-":
            return RespError(rest.decode("utf-8", "replace"))
        if kind == b":":
            return _int(line)
        if kind == b"$":
            n = _int(line)
            if n < 0:
                return None
            if n > _MAX_LINE:
                raise ProtocolError(f"a bulk reply of {n} bytes where a small reply was due")
            data = bytearray(n)
            self.read_into(memoryview(data))
            self.expect_crlf()
            return bytes(data)
        if kind == b"*":
            n = _int(line)
            if n < 0:
                return None
            if depth >= _MAX_ARRAY_DEPTH:
                raise ProtocolError("replies nest too deep")
            return [self.read_reply(depth + 1) for _ in range(n)]
        raise ProtocolError(f"unknown reply type {kind!r}")


def _int(line: bytes) -> int:
    try:
        return int(line[1:])
    except ValueError:
        raise ProtocolError(f"not an integer in {line[:32]!r}") from None

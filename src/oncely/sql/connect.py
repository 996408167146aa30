"""Connecting to PostgreSQL, every refusal counted and said.

The pool makes its connections in the background and retries the ones that
fail, so a server that refuses them (``max_connections`` reached, a wrong
password, nobody listening) would otherwise show only as statements waiting
for a connection. Each refusal counts in ``oncely_db_connect_errors_total``
by ``reason``, and a warning ``postgres.connect_refused`` names the reason,
the server (host, port, database, user: never the password) and what to do
(docs/production.md, "Connection budget"). One line per reason every
``LOG_EVERY_S`` at most, with how many refusals it stands for: a refusing
server is met by every pool's retries at once.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Self

import psycopg
import structlog
from psycopg import conninfo

from oncely import metrics

log = structlog.get_logger("oncely.sql")

LOG_EVERY_S = 10.0

Reason = Literal["too_many_clients", "auth", "unreachable", "other"]

# What libpq and the server say, by reason (their messages carry no SQLSTATE
# to the client at connect time).
_SIGNS: tuple[tuple[Reason, tuple[str, ...]], ...] = (
    (
        "too_many_clients",
        (
            "too many clients",
            "too many connections",
            "remaining connection slots are reserved",
            "no more connections allowed",  # PgBouncer's max_client_conn
        ),
    ),
    (
        "auth",
        (
            "authentication failed",
            "no pg_hba.conf entry",
            "password is required",
            "permission denied for database",
            "is not permitted to log in",
        ),
    ),
    (
        "unreachable",
        (
            "connection refused",
            "timeout expired",
            "timed out",
            "could not translate host name",
            "failed to resolve host",
            "no route to host",
            "network is unreachable",
            "could not connect",
            "the database system is",  # starting up, shutting down, in recovery
            "server closed the connection unexpectedly",
            "pgbouncer cannot connect to server",
        ),
    ),
)

_HINTS: dict[Reason, str] = {
    "too_many_clients": (
        "PostgreSQL's max_connections (or a role's or database's CONNECTION LIMIT, or a "
        "pooler's max_client_conn) is reached: fewer processes, a lower "
        "ONCELY_PG_POOL_MAX, or a pooler (docs/production.md, Connection budget)"
    ),
    "auth": "check the user and password in ONCELY_DATABASE_URL and the server's pg_hba.conf",
    "unreachable": "the server is down, restarting, or not reachable at this address",
    "other": "see the error",
}


def refusal_reason(error: BaseException) -> Reason:
    """Why a connection attempt failed, from libpq's or the server's words."""
    text = str(error).lower()
    for reason, signs in _SIGNS:
        if any(sign in text for sign in signs):
            return reason
    return "other"


class _RefusalLog:
    """At most one line per reason every ``LOG_EVERY_S``."""

    def __init__(self) -> None:
        self._logged_at: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}

    def refused(self, reason: Reason, error: BaseException, where: dict[str, str]) -> None:
        metrics.DB_CONNECT_ERRORS.labels(reason=reason).inc()
        self._unlogged[reason] = self._unlogged.get(reason, 0) + 1
        now = time.monotonic()
        if now - self._logged_at.get(reason, -LOG_EVERY_S) < LOG_EVERY_S:
            return
        self._logged_at[reason] = now
        log.warning(
            "postgres.connect_refused",
            reason=reason,
            refusals=self._unlogged.pop(reason),
            hint=_HINTS[reason],
            error=_last_line(error),
            **where,
        )


_refusals = _RefusalLog()


def refusal_line(error: BaseException) -> str:
    """A failed connect in one line: what the server or libpq said, and
    what to look at."""
    reason = refusal_reason(error)
    return _last_line(error) + ("" if reason == "other" else f" ({_HINTS[reason]})")


def _last_line(error: BaseException) -> str:
    """libpq's message without its "connection failed: …" preamble lines."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return (lines[0] if lines else type(error).__name__)[:300]


def server_of(dsn: str, kwargs: dict[str, Any]) -> dict[str, str]:
    """Host, port, database and user of a connection string: never its
    password (nor any other parameter)."""
    try:
        params = {**conninfo.conninfo_to_dict(dsn), **kwargs}
    except psycopg.ProgrammingError:
        return {}
    return {k: str(params[k]) for k in ("host", "port", "dbname", "user") if params.get(k)}


class CountedConnection(psycopg.AsyncConnection[Any]):
    """psycopg's connection, its failed connects counted and logged. The
    pool's ``connection_class``, and the relay's LISTEN connection."""

    @classmethod
    async def connect(cls, conninfo: str = "", **kwargs: Any) -> Self:
        try:
            return await super().connect(conninfo, **kwargs)
        except psycopg.OperationalError as exc:
            _refusals.refused(refusal_reason(exc), exc, server_of(conninfo, kwargs))
            raise

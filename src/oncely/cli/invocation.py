"""What every ``oncely`` command runs on: its exit codes, the options many
share, its settings (from the environment, ``--app`` and a running ``oncely
dev``), its coroutine run to an answer, and its arguments parsed or refused
with exit code 2.

Settings, logging and the servers' clients are imported by the functions
that need them, so that `oncely --version` and `--help` start at once.
"""

from __future__ import annotations

import asyncio
import errno
import json
import re
import socket
import sys
import unicodedata
import uuid
from collections.abc import Coroutine
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from oncely.cli import dev_address, terminal
from oncely.cli.terminal import literal

if TYPE_CHECKING:
    from oncely.settings import Settings

T = TypeVar("T")

# soft_wrap: an error is one line however long, whatever the terminal width.
err = terminal.console(stderr=True)

# Exit codes every command keeps (scripts rely on them): 2 is typer's usage
# error; 69 is sysexits' EX_UNAVAILABLE.
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_UNAVAILABLE = 69

JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Show what would be done; do nothing.")]
# ``--app`` after a server command too (``oncely dev --app m:a``), as before it.
AppOpt = Annotated[
    str | None,
    typer.Option("--app", help="The app to serve, as module:attribute (as oncely --app)."),
]
WorkflowsOpt = Annotated[
    list[str] | None,
    typer.Option("--workflow", "-w", help="Only this workflow (repeat for several; default all)."),
]
OneWorkflowOpt = Annotated[str | None, typer.Option("--workflow", "-w", help="Only this one.")]
HostOpt = Annotated[str, typer.Option(envvar="ONCELY_HOST", show_envvar=True, help="Bind address.")]
PortOpt = Annotated[
    int, typer.Option(envvar="ONCELY_PORT", show_envvar=True, min=1, max=65535, help="Port.")
]
DataDirOpt = Annotated[
    Path,
    typer.Option(envvar="ONCELY_DATA_DIR", show_envvar=True, help="Embedded servers' data."),
]

# Set by the --app option (of `oncely`, or of a server command) before a command runs.
_chosen_app: str | None = None


def set_app(app_spec: str | None) -> None:
    """``oncely --app`` (or ONCELY_APP); None undoes an earlier run's choice."""
    global _chosen_app
    _chosen_app = app_spec


def choose_app(app_spec: str | None) -> None:
    """A server command's own ``--app``, where given, over ``oncely --app``."""
    if app_spec is not None:
        set_app(app_spec)


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a command's coroutine; a server that does not answer is a message, not a traceback."""
    import psycopg
    import psycopg_pool
    import redis.exceptions

    from oncely.bootstrap.clients import DatabaseRefused
    from oncely.errors import NotInApp
    from oncely.sql.migrate import SchemaMismatch

    try:
        return _event_loop_run(coro)
    except SchemaMismatch as exc:
        err.print(literal(exc), style="red")
        raise typer.Exit(EXIT_FAILED) from None
    except DatabaseRefused as exc:
        err.print(literal(exc), style="red")
    except NotInApp as exc:
        err.print(literal(exc), style="red")
        raise typer.Exit(EXIT_USAGE) from None
    except psycopg.errors.UndefinedTable:
        err.print(
            "the database has no oncely tables (or not all of them): run `oncely migrate` first",
            style="red",
        )
        raise typer.Exit(EXIT_FAILED) from None
    except (psycopg.OperationalError, psycopg_pool.PoolTimeout) as exc:
        err.print(f"PostgreSQL did not answer: {literal(exc)}", style="red")
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        err.print(f"Redis did not answer: {literal(exc)}", style="red")
    except redis.exceptions.ResponseError as exc:
        if "DB index is out of range" not in str(exc):
            raise
        err.print(
            f"Redis refused the database number in ONCELY_REDIS_URL: {literal(exc)}", style="red"
        )
        raise typer.Exit(EXIT_USAGE) from None
    raise typer.Exit(EXIT_UNAVAILABLE)


def _event_loop_run(coro: Coroutine[Any, Any, T]) -> T:
    """uvloop where it is installed (not on Windows), asyncio's loop otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, default=str) + "\n")


def load_settings(*, find_dev: bool = True, app: bool = True, **overrides: Any) -> Settings:
    """The process's settings from the environment, ``--app`` and
    ``overrides``; without server URLs, those of an ``oncely dev`` running
    from the same data dir (``find_dev``). ``app``: the app is imported and
    checked (a command that serves none, a fake, says False)."""
    from pydantic import ValidationError

    from oncely.logs import configure_logging
    from oncely.settings import Settings

    try:
        settings = Settings()
    except ValidationError as exc:
        # Settings whose values are secrets, or may hold one (a URL's
        # password): never echoed back, not even a wrong one.
        secrets = {
            n
            for n, f in Settings.model_fields.items()
            if "SecretStr" in str(f.annotation) or n.endswith("_url")
        }
        for error in exc.errors():
            message = literal(error["msg"].removeprefix("Value error, "))
            if not error["loc"]:
                # A rule across settings: its message names them; its input
                # is every setting given, secrets too, so never shown.
                err.print(message, style="red")
                continue
            field = str(error["loc"][0])
            name = "ONCELY_" + "_".join(str(part) for part in error["loc"]).upper()
            got = "" if field in secrets else f" (got {literal(repr(error.get('input')))})"
            err.print(f"{name}: {message}{got}", style="red")
        raise typer.Exit(EXIT_USAGE) from None
    if _chosen_app:
        overrides["app"] = _chosen_app
    if overrides:
        settings = settings.model_copy(update=overrides)
    if find_dev and not (settings.redis_url and settings.database_url):
        settings = _with_running_dev(settings)
    configure_logging(settings.log_format, settings.log_level)
    if settings.otel:
        from oncely import tracing

        tracing.configure("oncely")
    if app:
        _check_app(settings)
    return settings


def _with_running_dev(settings: Settings) -> Settings:
    """The URLs (and app) of the ``oncely dev`` running from this data dir."""
    found = dev_address.running(settings.data_dir)
    if found is None:
        return settings
    update: dict[str, Any] = {
        "redis_url": settings.redis_url or found.redis_url,
        "database_url": settings.database_url or found.database_url,
    }
    if "app" not in settings.model_fields_set:
        update["app"] = found.app
    # A worker or relay run apart (oncely dev --no-worker) talks to the
    # stack's fakes and signs with its secret, as the stack's own would.
    for name, value in found.providers.items():
        if name not in settings.model_fields_set and value:
            update[name] = value
    secret = settings.data_dir / "dev-webhook-secret"
    if not settings.webhook_secret.get_secret_value() and secret.exists():
        from pydantic import SecretStr

        update["webhook_secret"] = SecretStr(secret.read_text().strip())
    err.print(
        f"using the oncely dev stack running from {literal(str(settings.data_dir))}"
        f" (pid {found.pid})",
        style="dim",
    )
    return settings.model_copy(update=update)


def _check_app(settings: Settings) -> None:
    """A wrong --app is one readable line and exit code 2, before anything starts."""
    from oncely.app import load_app
    from oncely.shadow.config import check_workflows, parse_primary, parse_shadow

    try:
        app = load_app(settings.app)
    except ValueError as exc:
        err.print(f"--app / ONCELY_APP: {literal(exc)}", style="red")
        raise typer.Exit(EXIT_USAGE) from None
    try:
        shadows, primary = parse_shadow(settings.shadow), parse_primary(settings.primary)
        check_workflows(shadows, primary, app.names, settings.app)
    except ValueError as exc:
        err.print(f"ONCELY_SHADOW / ONCELY_PRIMARY: {literal(exc)}", style="red")
        raise typer.Exit(EXIT_USAGE) from None


def known_workflows(settings: Settings, names: list[str] | None) -> list[str]:
    """``--workflow`` names the app has, or a usage error (exit 2) naming the rest."""
    from oncely.app import load_app

    known = load_app(settings.app).names
    unknown = [n for n in names or [] if n not in known]
    if unknown:
        err.print(
            f"--workflow: no workflow {literal(unknown)} in {literal(settings.app)} (has {known})",
            style="red",
        )
        raise typer.Exit(EXIT_USAGE)
    return names or []


def port_taken(host: str, port: int) -> bool:
    """Whether ``host:port`` cannot be bound the way the servers bind it
    (SO_REUSEADDR: a port in TIME_WAIT is free)."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return False  # the server says what is wrong with the host
    for family, kind, proto, _, address in found:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return True
    return False


def require_port(host: str, port: int) -> None:
    """A server command's port, free, or one line and exit code 69 (a
    server that cannot bind would otherwise log and hang)."""
    if port_taken(host, port):
        err.print(f"port {port} on {host} is taken: stop what holds it, or use --port", style="red")
        raise typer.Exit(EXIT_UNAVAILABLE)


# A tenant's name, as long as the settings allow the scheduler's.
_TENANT_MAX = 200


def parse_tenant(text: str, option: str = "the tenant", *, new: bool = False) -> str:
    """A tenant's name as given, or a usage error (exit 2): not empty; for a
    ``new`` one (a key made for it), also no space at either end (``"acme "``
    would be a tenant apart that looks like ``acme``), no control or
    invisible formatting character, at most 200 characters. A name already
    in the data (one the API's scheme made) is looked up as it is."""
    if not text.strip():
        err.print(f"{option} must not be empty", style="red")
        raise typer.Exit(EXIT_USAGE)
    if not new:
        return text
    bad = (
        text != text.strip()
        or len(text) > _TENANT_MAX
        or any(unicodedata.category(c) in ("Cc", "Cf") for c in text)
    )
    if bad:
        err.print(
            f"{option}: a tenant is 1-{_TENANT_MAX} characters, none of them control or"
            " formatting characters, with no space at either end",
            style="red",
        )
        raise typer.Exit(EXIT_USAGE)
    return text


def parse_job_id(text: str) -> uuid.UUID:
    """A job id argument, or a usage error (exit 2)."""
    try:
        return uuid.UUID(text)
    except ValueError:
        err.print(f"not a job id: {literal(repr(text))}", style="red")
        raise typer.Exit(EXIT_USAGE) from None


def parse_since(value: str | None) -> datetime:
    """``--since`` as an aware time, or a usage error (exit 2)."""
    if value is None:
        return datetime(1970, 1, 1, tzinfo=UTC)
    match = re.fullmatch(r"(\d+)([smhd])", value.strip())
    if match:
        unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[match[2]]
        try:
            return datetime.now(UTC) - timedelta(**{unit: int(match[1])})
        except (OverflowError, ValueError):
            return datetime(1970, 1, 1, tzinfo=UTC)  # further back than anything stored
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        err.print(
            f"--since: want 30m, 6h, 7d or an ISO 8601 time, got {literal(repr(value))}",
            style="red",
        )
        raise typer.Exit(EXIT_USAGE) from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)

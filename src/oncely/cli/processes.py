"""The processes: ``oncely migrate``, ``api``, ``worker``, ``relay``, ``dev``
(all of them in one), and ``status`` (what they have in hand)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from oncely.cli.invocation import (
    EXIT_FAILED,
    EXIT_UNAVAILABLE,
    AppOpt,
    DataDirOpt,
    HostOpt,
    JsonOpt,
    PortOpt,
    WorkflowsOpt,
    choose_app,
    err,
    known_workflows,
    load_settings,
    require_port,
    run,
)
from oncely.cli.terminal import literal

CheckOpt = Annotated[
    bool, typer.Option("--check", help="Change nothing; exit 1 if migrations are pending.")
]


def migrate(check: CheckOpt = False) -> None:
    """Apply pending database migrations (safe to run from many processes at once)."""
    from oncely.bootstrap.clients import require_urls
    from oncely.sql.migrate import MigrationChanged, check_schema
    from oncely.sql.migrate import migrate as run_migrations

    settings = load_settings()
    _, database_url = require_urls(settings)
    if check:
        problem = run(check_schema(database_url)).problem()
        if problem:
            err.print(problem, style="red")
            raise typer.Exit(EXIT_FAILED)
        err.print("the database schema is current")
        return
    try:
        applied = run(run_migrations(database_url))
    except MigrationChanged as exc:
        err.print(literal(str(exc)), style="red")
        raise typer.Exit(EXIT_FAILED) from None
    err.print(f"applied {len(applied)} migration(s)" + (f": {applied}" if applied else ""))


def api(host: HostOpt = "127.0.0.1", port: PortOpt = 8000, app_spec: AppOpt = None) -> None:
    """Serve the HTTP API."""
    from oncely.bootstrap.processes import serve_api

    choose_app(app_spec)
    settings = load_settings()
    require_port(host, port)
    run(serve_api(settings, host=host, port=port))


def worker(workflow: WorkflowsOpt = None, app_spec: AppOpt = None) -> None:
    """Run a stream worker for the app's workflows (SIGTERM drains in-flight jobs)."""
    from oncely.bootstrap.processes import run_worker

    choose_app(app_spec)
    settings = load_settings()
    run(run_worker(settings, known_workflows(settings, workflow)))


def relay(app_spec: AppOpt = None) -> None:
    """Run an outbox relay: deliver every effect once (SIGTERM finishes sends in flight)."""
    from oncely.bootstrap.processes import run_relay

    choose_app(app_spec)
    run(run_relay(load_settings()))


def dev(
    port: PortOpt = 8000,
    data_dir: DataDirOpt = Path(".oncely"),
    app_spec: AppOpt = None,
    worker: Annotated[
        bool, typer.Option(help="Run the workers here; --no-worker: run `oncely worker` apart.")
    ] = True,
    relay: Annotated[
        bool, typer.Option(help="Run the relay here; --no-relay: run `oncely relay` apart.")
    ] = True,
) -> None:
    """Everything in one command: embedded servers, migrations, a dev key and all processes."""
    from oncely.cli.dev import DevRefused, run_dev

    choose_app(app_spec)
    settings = load_settings(find_dev=False, data_dir=data_dir, log_format="console")
    try:
        run(run_dev(settings, port=port, workers=worker, relay=relay))
    except DevRefused as exc:
        err.print(literal(str(exc)), style="red")
        raise typer.Exit(EXIT_UNAVAILABLE) from None


def status(
    as_json: JsonOpt = False,
) -> None:
    """Per workflow: stream, pending, consumers, dead letters, jobs; and the outbox."""
    from oncely.cli.ops import show_status

    run(show_status(load_settings(), as_json=as_json))

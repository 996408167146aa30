"""`oncely`: every process and operator command.

The CLI is the composition root's front door: it builds Settings once,
opens pools and clients (``bootstrap``), and hands them to the services.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
import uuid
from collections.abc import Coroutine
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar, cast

import typer

from oncely.cli import dev_address, terminal
from oncely.cli.terminal import literal

# Settings, logging and asyncio are imported by the commands that need them,
# so that `oncely --version` and `--help` start at once.
if TYPE_CHECKING:
    from oncely.settings import Settings
    from oncely.shadow.report import VariantReport
    from oncely.usage.ledger import GroupBy

T = TypeVar("T")

# Help is plain text (click's): no type placeholders on flags (`<bool>`),
# and nothing but text when it goes to a file or a pipe.
app = typer.Typer(
    help="oncely: exactly-once effects for LLM steps in business workflows.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
keys_app = typer.Typer(help="API keys: a bearer token per tenant.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
dlq_app = typer.Typer(help="Dead letters: inspect and replay.", no_args_is_help=True)
app.add_typer(dlq_app, name="dlq")
outbox_app = typer.Typer(help="The outbox: notifications waiting or failed.", no_args_is_help=True)
app.add_typer(outbox_app, name="outbox")
tenants_app = typer.Typer(help="Tenants' data.", no_args_is_help=True)
app.add_typer(tenants_app, name="tenants")
eval_app = typer.Typer(
    help="Shadow runs (ONCELY_SHADOW): agreement reports and promotion gates.",
    no_args_is_help=True,
)
app.add_typer(eval_app, name="eval")
usage_app = typer.Typer(help="What model calls cost: the usage ledger.", no_args_is_help=True)
app.add_typer(usage_app, name="usage")
schedules_app = typer.Typer(help="Workflows on a timetable.", no_args_is_help=True)
app.add_typer(schedules_app, name="schedules")
jobs_app = typer.Typer(
    help="Jobs: one in detail, cancel one, rerun one from a checkpoint.", no_args_is_help=True
)
app.add_typer(jobs_app, name="jobs")

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


# Set by the --app option before any command runs.
_chosen_app: str | None = None


def _print_version(value: bool) -> None:
    if value:
        from oncely import __version__

        typer.echo(f"oncely {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    app_spec: Annotated[
        str | None,
        typer.Option(
            "--app",
            envvar="ONCELY_APP",
            show_envvar=True,
            help="The app to serve, as module:attribute (default oncely.builtin:app).",
        ),
    ] = None,
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version."
        ),
    ] = False,
) -> None:
    """oncely: exactly-once effects for LLM steps in business workflows."""
    global _chosen_app
    _chosen_app = app_spec


# ``--app`` after a server command too (``oncely dev --app m:a``), as before it.
AppOpt = Annotated[
    str | None,
    typer.Option("--app", help="The app to serve, as module:attribute (as oncely --app)."),
]


def _choose_app(app_spec: str | None) -> None:
    global _chosen_app
    if app_spec is not None:
        _chosen_app = app_spec


WorkflowsOpt = Annotated[
    list[str] | None,
    typer.Option("--workflow", "-w", help="Only this workflow (repeat for several; default all)."),
]

HostOpt = Annotated[str, typer.Option(envvar="ONCELY_HOST", show_envvar=True, help="Bind address.")]
PortOpt = Annotated[int, typer.Option(envvar="ONCELY_PORT", show_envvar=True, help="Port.")]
DataDirOpt = Annotated[
    Path,
    typer.Option(envvar="ONCELY_DATA_DIR", show_envvar=True, help="Embedded servers' data."),
]


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a command's coroutine; a server that does not answer is a message, not a traceback."""
    import psycopg
    import psycopg_pool
    import redis.exceptions

    from oncely.sql.migrate import SchemaMismatch

    try:
        return _event_loop_run(coro)
    except SchemaMismatch as exc:
        err.print(literal(exc), style="red")
        raise typer.Exit(EXIT_FAILED) from None
    except (psycopg.OperationalError, psycopg_pool.PoolTimeout) as exc:
        err.print(f"PostgreSQL did not answer: {literal(exc)}", style="red")
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        err.print(f"Redis did not answer: {literal(exc)}", style="red")
    raise typer.Exit(EXIT_UNAVAILABLE)


def _event_loop_run(coro: Coroutine[Any, Any, T]) -> T:
    """uvloop where it is installed (not on Windows), asyncio's loop otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, default=str) + "\n")


def _settings(*, find_dev: bool = True, **overrides: Any) -> Settings:
    """The process's settings from the environment, ``--app`` and
    ``overrides``; without server URLs, those of an ``oncely dev`` running
    from the same data dir (``find_dev``)."""
    from pydantic import ValidationError

    from oncely.logs import configure_logging
    from oncely.settings import Settings

    try:
        settings = Settings()
    except ValidationError as exc:
        # Settings whose values are secrets: never echoed back, not even a wrong one.
        secrets = {n for n, f in Settings.model_fields.items() if "SecretStr" in str(f.annotation)}
        for error in exc.errors():
            field = str(error["loc"][0]) if error["loc"] else ""
            name = "ONCELY_" + "_".join(str(part) for part in error["loc"]).upper()
            message = error["msg"].removeprefix("Value error, ")
            got = "" if field in secrets else f" (got {literal(repr(error.get('input')))})"
            err.print(f"{name}: {literal(message)}{got}", style="red")
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


def _workflows(settings: Settings, names: list[str] | None) -> list[str]:
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


@app.command()
def migrate(
    check: Annotated[
        bool, typer.Option("--check", help="Change nothing; exit 1 if migrations are pending.")
    ] = False,
) -> None:
    """Apply pending database migrations (safe to run from many processes at once)."""
    from oncely.bootstrap.clients import require_urls
    from oncely.sql.migrate import MigrationChanged, check_schema
    from oncely.sql.migrate import migrate as run_migrations

    _, database_url = require_urls(_settings())
    if check:
        problem = _run(check_schema(database_url)).problem()
        if problem:
            err.print(problem, style="red")
            raise typer.Exit(EXIT_FAILED)
        err.print("the database schema is current")
        return
    try:
        applied = _run(run_migrations(database_url))
    except MigrationChanged as exc:
        err.print(literal(str(exc)), style="red")
        raise typer.Exit(EXIT_FAILED) from None
    err.print(f"applied {len(applied)} migration(s)" + (f": {applied}" if applied else ""))


@app.command()
def api(host: HostOpt = "127.0.0.1", port: PortOpt = 8000, app_spec: AppOpt = None) -> None:
    """Serve the HTTP API."""
    from oncely.bootstrap.processes import serve_api

    _choose_app(app_spec)
    _run(serve_api(_settings(), host=host, port=port))


@app.command()
def worker(workflow: WorkflowsOpt = None, app_spec: AppOpt = None) -> None:
    """Run a stream worker for the app's workflows (SIGTERM drains in-flight jobs)."""
    from oncely.bootstrap.processes import run_worker

    _choose_app(app_spec)
    settings = _settings()
    _run(run_worker(settings, _workflows(settings, workflow)))


@app.command()
def relay(app_spec: AppOpt = None) -> None:
    """Run an outbox relay: deliver every effect once (SIGTERM finishes sends in flight)."""
    from oncely.bootstrap.processes import run_relay

    _choose_app(app_spec)
    _run(run_relay(_settings()))


@app.command("fake-llm")
def fake_llm(
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8101,
    rpm: Annotated[
        int,
        typer.Option(envvar="ONCELY_FAKE_RPM", show_envvar=True, help="Requests/min, then 429."),
    ] = 0,
    tpm: Annotated[
        int, typer.Option(envvar="ONCELY_FAKE_TPM", show_envvar=True, help="Tokens/min, then 429.")
    ] = 0,
    fault_rate: Annotated[
        float,
        typer.Option(
            envvar="ONCELY_FAKE_FAULT_RATE",
            show_envvar=True,
            min=0.0,
            max=1.0,
            help="Share of calls failing at random (half 429, half 503).",
        ),
    ] = 0.0,
    seed: Annotated[
        int,
        typer.Option(envvar="ONCELY_FAKE_SEED", show_envvar=True, help="Seed for random faults."),
    ] = 0,
    faults: Annotated[
        str,
        typer.Option(
            envvar="ONCELY_FAKE_LLM_FAULTS",
            show_envvar=True,
            help="Random faults per call, kind=rate: 429, 503, hang, drip, slow, badjson "
            "(e.g. 429=0.05,503=0.05,slow=0.05).",
        ),
    ] = "",
    slow_s: Annotated[
        float,
        typer.Option(
            envvar="ONCELY_FAKE_SLOW_S", show_envvar=True, help="How long a slow call takes."
        ),
    ] = 2.0,
) -> None:
    """Serve the fake OpenAI-compatible model; directives in the prompt script its faults."""
    from oncely.fakes.llm import RANDOM_FAULTS, serve_fake_llm

    rates = _fault_rates(faults, RANDOM_FAULTS)
    _settings()
    _serve_forever(
        serve_fake_llm(
            host,
            port,
            rpm=rpm,
            tpm=tpm,
            fault_rate=fault_rate,
            seed=seed,
            faults=rates,
            slow_s=slow_s,
        )
    )


@app.command("fake-mail")
def fake_mail(
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8102,
    mailbox: Annotated[
        Path | None,
        typer.Option(
            envvar="ONCELY_FAKE_MAILBOX", show_envvar=True, help="Append every email to this JSONL."
        ),
    ] = None,
    faults: Annotated[
        str,
        typer.Option(
            envvar="ONCELY_FAKE_MAIL_FAULTS",
            show_envvar=True,
            help="Random faults per POST, kind=rate: 503, timeout (held past the sender's "
            "timeout), drop (delivered, then the connection closed unanswered).",
        ),
    ] = "",
    seed: Annotated[
        int,
        typer.Option(envvar="ONCELY_FAKE_SEED", show_envvar=True, help="Seed for random faults."),
    ] = 0,
    hold_s: Annotated[
        float,
        typer.Option(
            envvar="ONCELY_FAKE_HOLD_S", show_envvar=True, help="How long a timeout holds a POST."
        ),
    ] = 30.0,
) -> None:
    """Serve the fake mail and webhook provider (dedupes on Idempotency-Key / webhook-id)."""
    from oncely.fakes.mail import RANDOM_FAULTS, serve_fake_mail

    rates = _fault_rates(faults, RANDOM_FAULTS)
    _settings()
    _serve_forever(serve_fake_mail(host, port, mailbox, faults=rates, seed=seed, hold_s=hold_s))


def _fault_rates(text: str, kinds: tuple[str, ...]) -> dict[str, float]:
    """``--faults`` parsed, or a usage error (exit 2) naming what is wrong."""
    from oncely.fakes.faults import parse_rates

    try:
        return parse_rates(text, kinds)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--faults") from None


def _serve_forever(coro: Coroutine[Any, Any, None]) -> None:
    """Run a server coroutine until SIGTERM or Ctrl-C."""

    async def main() -> None:
        from oncely.bootstrap.processes import stop_on_signals

        task = asyncio.create_task(coro)
        with stop_on_signals(task.cancel), contextlib.suppress(asyncio.CancelledError):
            await task

    _run(main())


@keys_app.command("create")
def keys_create(
    tenant: Annotated[str, typer.Option(help="The tenant this key acts for.")],
    as_json: JsonOpt = False,
) -> None:
    """Create an API key. Prints the key alone on stdout, once; only its hash is stored."""
    from oncely.cli.ops import create_key

    if not tenant.strip():
        err.print("--tenant must not be empty", style="red")
        raise typer.Exit(EXIT_USAGE)
    key, key_id = _run(create_key(_settings(), tenant))
    err.print(f"created key {key_id} for tenant {literal(tenant)}; it is shown only now")
    if as_json:
        _print_json({"id": key_id, "tenant": tenant, "key": key})
    else:
        sys.stdout.write(key + "\n")


@keys_app.command("list")
def keys_list(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's keys.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List API keys: id, tenant, created, last used, revoked (never the secret)."""
    from oncely.cli.ops import show_keys

    _run(show_keys(_settings(), tenant=tenant, as_json=as_json))


@keys_app.command("revoke")
def keys_revoke(
    key: Annotated[
        str | None,
        typer.Argument(help="The key itself (prefer --id: a secret on a command line leaks)."),
    ] = None,
    key_id: Annotated[str | None, typer.Option("--id", help="The key's id (keys list).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Revoke an API key: every API process refuses it within about a second."""
    from oncely.cli.ops import revoke_key

    if (key is None) == (key_id is None):
        err.print("give --id ID (or the key itself)", style="red")
        raise typer.Exit(EXIT_USAGE)
    tenant = _run(revoke_key(_settings(), key=key, key_id=key_id))
    if tenant is None:
        err.print("no such active key", style="red")
        raise typer.Exit(EXIT_NOT_FOUND)
    if as_json:
        _print_json({"revoked": key_id or "by key", "tenant": tenant})
    err.print(
        f"revoked a key of tenant {literal(tenant)}; every API process refuses it within"
        " about a second (within ONCELY_API_KEY_CACHE_S if Redis did not answer)"
    )


@app.command()
def dev(
    port: PortOpt = 8000,
    data_dir: DataDirOpt = Path(".oncely"),
    app_spec: AppOpt = None,
) -> None:
    """Everything in one command: embedded servers, migrations, a dev key and all processes."""
    from oncely.cli.dev import DevRefused, run_dev

    _choose_app(app_spec)
    settings = _settings(find_dev=False, data_dir=data_dir, log_format="console")
    try:
        _run(run_dev(settings, port=port))
    except DevRefused as exc:
        err.print(literal(str(exc)), style="red")
        raise typer.Exit(EXIT_UNAVAILABLE) from None


@app.command()
def status(
    as_json: JsonOpt = False,
) -> None:
    """Per workflow: stream, pending, consumers, dead letters, jobs; and the outbox."""
    from oncely.cli.ops import show_status

    _run(show_status(_settings(), as_json=as_json))


@dlq_app.command("list")
def dlq_list(
    limit: Annotated[int, typer.Option(help="How many per workflow, newest first.")] = 50,
    workflow: Annotated[str | None, typer.Option("--workflow", "-w", help="Only this one.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List dead letters with their workflow, reason, delivery count and last error."""
    from oncely.cli.ops import show_dead_letters

    settings = _settings()
    _workflows(settings, [workflow] if workflow else None)
    _run(show_dead_letters(settings, limit=limit, workflow=workflow, as_json=as_json))


@dlq_app.command("replay")
def dlq_replay(
    dead_id: Annotated[
        str | None, typer.Argument(help="The dead letter's id: its job's id (dlq list).")
    ] = None,
    replay_all: Annotated[bool, typer.Option("--all", help="Replay every dead letter.")] = False,
    workflow: Annotated[str | None, typer.Option("--workflow", "-w", help="Only this one.")] = None,
    dry_run: DryRunOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Put dead letters back in their stream (the job becomes queued again)."""
    from oncely.cli.ops import replay_dead_letters

    if (dead_id is None) == (not replay_all):
        err.print("give one dead letter id, or --all", style="red")
        raise typer.Exit(EXIT_USAGE)
    if dry_run and not replay_all:
        err.print("--dry-run goes with --all", style="red")
        raise typer.Exit(EXIT_USAGE)
    settings = _settings()
    _workflows(settings, [workflow] if workflow else None)
    replayed = _run(replay_dead_letters(settings, dead_id, workflow=workflow, dry_run=dry_run))
    if dead_id is not None and not replayed:
        err.print(f"no dead letter {literal(dead_id)}", style="red")
        raise typer.Exit(EXIT_NOT_FOUND)
    verb = "would replay" if dry_run else "replayed"
    if as_json:
        _print_json({"dry_run": dry_run, "replayed": replayed})
    else:
        for item in replayed:
            sys.stdout.write(f"{verb} {item['workflow']} job {item['job_id']}\n")
    err.print(f"{verb} {len(replayed)} dead letter(s)")


@outbox_app.command("list")
def outbox_list(
    failed: Annotated[bool, typer.Option("--failed", help="Only rows that gave up.")] = False,
    limit: Annotated[int, typer.Option(help="How many rows.")] = 50,
    as_json: JsonOpt = False,
) -> None:
    """List outbox rows not yet sent (or, with --failed, the ones that gave up)."""
    from oncely.cli.ops import show_outbox

    _run(show_outbox(_settings(), failed_only=failed, limit=limit, as_json=as_json))


@schedules_app.command("list")
def schedules_list(as_json: JsonOpt = False) -> None:
    """List the scheduled workflows: their timetable, last tick and job, next tick."""
    from oncely.cli.ops import show_schedules

    _run(show_schedules(_settings(), as_json=as_json))


@outbox_app.command("retry")
def outbox_retry(
    row_id: Annotated[int | None, typer.Argument(help="The outbox row id.")] = None,
    all_failed: Annotated[bool, typer.Option("--all-failed", help="Every failed row.")] = False,
    dry_run: DryRunOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Send failed rows again (attempts reset)."""
    from oncely.cli.ops import retry_outbox

    if (row_id is None) == (not all_failed):
        err.print("give one row id, or --all-failed", style="red")
        raise typer.Exit(EXIT_USAGE)
    if dry_run and not all_failed:
        err.print("--dry-run goes with --all-failed", style="red")
        raise typer.Exit(EXIT_USAGE)
    ids = _run(retry_outbox(_settings(), row_id, dry_run=dry_run))
    if row_id is not None and not ids:
        err.print(f"no failed row {row_id}", style="red")
        raise typer.Exit(EXIT_NOT_FOUND)
    verb = "would schedule" if dry_run else "scheduled"
    if as_json:
        _print_json({"dry_run": dry_run, "scheduled": ids})
    else:
        for row in ids:
            sys.stdout.write(f"{verb} outbox row {row}\n")
    err.print(f"{verb} {len(ids)} row(s) for sending")


@jobs_app.command("show")
def jobs_show(
    job_id: Annotated[str, typer.Argument(help="The job's id.")],
    workflow: Annotated[str | None, typer.Option("--workflow", "-w", help="Only this one.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """A job: request, result, usage, error, checkpoints (with values), what it
    waits for, deliveries, its message now, outbox rows."""
    from oncely.cli.ops import show_job

    parsed = _job_id(job_id)
    settings = _settings()
    _workflows(settings, [workflow] if workflow else None)
    if not _run(show_job(settings, parsed, workflow=workflow, as_json=as_json)):
        err.print(
            f"no job {parsed}" + (f" in {literal(workflow)}" if workflow else ""), style="red"
        )
        raise typer.Exit(EXIT_NOT_FOUND)


def _job_id(text: str) -> uuid.UUID:
    """A job id argument, or a usage error (exit 2)."""
    try:
        return uuid.UUID(text)
    except ValueError:
        err.print(f"not a job id: {literal(repr(text))}", style="red")
        raise typer.Exit(EXIT_USAGE) from None


@jobs_app.command("cancel")
def jobs_cancel(
    job_id: Annotated[str, typer.Argument(help="The job's id.")],
    workflow: Annotated[str | None, typer.Option("--workflow", "-w", help="Only this one.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Cancel a queued, running or waiting job: nothing more is written for it.
    Exit 1 if it is already done or dead, 3 if there is no such job."""
    from oncely.cli.ops import cancel_job

    parsed = _job_id(job_id)
    settings = _settings()
    _workflows(settings, [workflow] if workflow else None)
    found = _run(cancel_job(settings, parsed, workflow=workflow))
    if found is None:
        err.print(
            f"no job {parsed}" + (f" in {literal(workflow)}" if workflow else ""), style="red"
        )
        raise typer.Exit(EXIT_NOT_FOUND)
    status = found.status if found.finished else "cancelled"
    if as_json:
        _print_json({"job_id": str(parsed), "workflow": found.kind, "status": status})
    else:
        sys.stdout.write(f"{parsed} {status}\n")
    if found.finished:
        err.print(f"the job is {found.status}: nothing to cancel", style="red")
        raise typer.Exit(EXIT_FAILED)


@jobs_app.command("approve")
def jobs_approve(
    job_id: Annotated[str, typer.Argument(help="The job's id.")],
    call_id: Annotated[str, typer.Argument(help="The tool call it waits on (jobs show).")],
    reject: Annotated[bool, typer.Option("--reject", help="Reject it instead.")] = False,
    reason: Annotated[str | None, typer.Option("--reason", help="Why (the model is told).")] = None,
    arguments: Annotated[
        str | None, typer.Option("--arguments", help="Edited arguments, as a JSON object.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Approve (or --reject) a tool call an agent's job waits on: the job
    resumes. Exit 1 if it was decided otherwise before or the job is
    finished, 3 if there is no such job or pending call."""
    from oncely.cli.ops import decide_approval

    parsed = _job_id(job_id)
    decision: dict[str, Any] = {"approved": not reject}
    if reason is not None:
        decision["reason"] = reason
    if arguments is not None:
        try:
            edited = json.loads(arguments)
        except ValueError:
            edited = None
        if not isinstance(edited, dict):
            err.print("--arguments must be a JSON object", style="red")
            raise typer.Exit(EXIT_USAGE)
        decision["arguments"] = edited
    outcome = _run(decide_approval(_settings(), parsed, call_id, decision))
    if outcome is None or outcome.outcome == "missing":
        err.print(f"no job {parsed} waiting on tool call {literal(repr(call_id))}", style="red")
        raise typer.Exit(EXIT_NOT_FOUND)
    if outcome.outcome in ("conflict", "finished"):
        why = (
            "it was decided otherwise before"
            if outcome.outcome == "conflict"
            else (f"the job is {outcome.status}")
        )
        err.print(f"not decided: {why}", style="red")
        raise typer.Exit(EXIT_FAILED)
    status = "rejected" if reject else "approved"
    if as_json:
        _print_json({"job_id": str(parsed), "call_id": call_id, "status": status})
    else:
        sys.stdout.write(f"{parsed} {call_id} {status}\n")


@jobs_app.command("list")
def jobs_list(
    workflow: Annotated[str | None, typer.Option("--workflow", "-w", help="Only this one.")] = None,
    status: Annotated[
        str | None, typer.Option("--status", help="queued, waiting, done, dead or cancelled.")
    ] = None,
    reason: Annotated[
        str | None,
        typer.Option("--reason", help="A dead job's reason (nondeterministic, max_age, ...)."),
    ] = None,
    parent: Annotated[
        str | None, typer.Option("--parent", help="Only the child jobs of this job's maps.")
    ] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, max=10_000)] = 100,
    as_json: JsonOpt = False,
) -> None:
    """Jobs newest first, of any tenant: of a workflow, a status, a dead reason, a parent."""
    from oncely.cli.ops import list_jobs, print_jobs

    settings = _settings()
    _workflows(settings, [workflow] if workflow else None)
    found = _run(
        list_jobs(
            settings,
            workflow=workflow,
            status=status,
            reason=reason,
            limit=limit,
            parent=None if parent is None else _job_id(parent),
        )
    )
    print_jobs(found, as_json=as_json)


@jobs_app.command("rewind")
def jobs_rewind(
    job_id: Annotated[str | None, typer.Argument(help="The job's id (dead or cancelled).")] = None,
    to: Annotated[
        str | None,
        typer.Option(
            "--to",
            help="The checkpoint to run again from (jobs show lists them): it and "
            "every later one are deleted.",
        ),
    ] = None,
    all_nondeterministic: Annotated[
        bool,
        typer.Option(
            "--all-nondeterministic",
            help="Every job dead as nondeterministic (a deploy changed its step).",
        ),
    ] = False,
    to_last_match: Annotated[
        bool,
        typer.Option(
            "--to-last-match",
            help="With --all-nondeterministic: rerun each from its first checkpoint "
            "that no longer matches the code, keeping the ones that do.",
        ),
    ] = False,
    dry_run: DryRunOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Rerun a dead or cancelled job from a checkpoint, or every job a deploy
    made nondeterministic. Effects it emits again keep their dedupe keys, so
    one already sent is not sent again. Exit 1 if the job is not dead or
    cancelled, 3 if the job or the checkpoint is unknown."""
    if all_nondeterministic:
        if job_id is not None or to is not None or not to_last_match:
            err.print(
                "--all-nondeterministic goes with --to-last-match, no job id or --to", style="red"
            )
            raise typer.Exit(EXIT_USAGE)
        _rewind_nondeterministic(dry_run=dry_run, as_json=as_json)
        return
    if job_id is None or to is None or to_last_match or dry_run:
        err.print(
            "give a job id and --to KEY (or --all-nondeterministic --to-last-match)", style="red"
        )
        raise typer.Exit(EXIT_USAGE)
    _rewind_one(_job_id(job_id), to, as_json=as_json)


def _rewind_one(parsed: uuid.UUID, to: str, *, as_json: bool) -> None:
    from oncely.cli.ops import checkpoint_keys, rewind_job

    settings = _settings()
    rewound = _run(rewind_job(settings, parsed, to))
    if rewound is None:
        err.print(f"no job {parsed}", style="red")
        raise typer.Exit(EXIT_NOT_FOUND)
    if rewound.status not in ("dead", "cancelled"):
        err.print(f"the job is {rewound.status}: only dead or cancelled jobs rewind", style="red")
        raise typer.Exit(EXIT_FAILED)
    if not rewound.deleted:
        keys = _run(checkpoint_keys(settings, parsed))
        err.print(f"no checkpoint {literal(repr(to))}; the job has {keys}", style="red")
        raise typer.Exit(EXIT_NOT_FOUND)
    if as_json:
        _print_json({"job_id": str(parsed), "status": "queued", "deleted": rewound.deleted})
    else:
        sys.stdout.write(f"{parsed} queued; deleted {', '.join(rewound.deleted)}\n")


def _rewind_nondeterministic(*, dry_run: bool, as_json: bool) -> None:
    from oncely.cli.ops import rewind_nondeterministic

    done = _run(rewind_nondeterministic(_settings(), limit=10_000, dry_run=dry_run))
    verb = "would rerun" if dry_run else "queued"
    if as_json:
        _print_json(
            {"dry_run": dry_run, "jobs": [{"job_id": j, "from": key} for j, key, _ in done]}
        )
    else:
        for job, key, _ in done:
            sys.stdout.write(f"{job} {verb} from {key}\n")
    err.print(f"{verb} {len(done)} job(s)")


@tenants_app.command("erase")
def tenants_erase(
    tenant: Annotated[str, typer.Argument(help="The tenant whose data goes.")],
    as_json: JsonOpt = False,
) -> None:
    """Delete every job, result, outbox row, queued message and API key of a tenant."""
    from oncely.cli.ops import erase_tenant

    if not tenant.strip():
        err.print("the tenant must not be empty", style="red")
        raise typer.Exit(EXIT_USAGE)
    counts = _run(erase_tenant(_settings(), tenant))
    if as_json:
        _print_json({"tenant": tenant, "deleted": counts})
        return
    for name, n in counts.items():
        sys.stdout.write(f"{name}: {n}\n")
    err.print(f"erased tenant {literal(tenant)}")


@tenants_app.command("usage")
def tenants_usage(
    tenant: Annotated[str, typer.Argument(help="The tenant.")],
    as_json: JsonOpt = False,
) -> None:
    """Today's model spend of a tenant (UTC): tokens, cost, calls, against its budgets."""
    from oncely.cli.ops import tenant_usage

    if not tenant.strip():
        err.print("the tenant must not be empty", style="red")
        raise typer.Exit(EXIT_USAGE)
    _run(tenant_usage(_settings(), tenant, as_json=as_json))


GroupByOpt = Annotated[
    str, typer.Option("--by", help="Group by tenant, workflow, model or day (UTC).")
]


@usage_app.command("report")
def usage_report(
    since: Annotated[
        str,
        typer.Option(
            help="Calls since then: a duration back from now (30m, 6h, 7d) or an ISO time."
        ),
    ] = "24h",
    by: GroupByOpt = "workflow",
    as_json: JsonOpt = False,
) -> None:
    """Model calls, tokens, cost and wasted calls (calls that produced no checkpoint)."""
    from oncely.cli.ops import usage_report as report

    if by not in ("tenant", "workflow", "model", "day"):
        err.print(
            f"--by: want tenant, workflow, model or day, got {literal(repr(by))}", style="red"
        )
        raise typer.Exit(EXIT_USAGE)
    group: GroupBy = cast("GroupBy", by)
    _run(report(_settings(), since=_since(since), by=group, as_json=as_json))


EvalWorkflowOpt = Annotated[str, typer.Option("--workflow", "-w", help="The workflow.")]
SinceOpt = Annotated[
    str | None,
    typer.Option(
        help="Only shadow runs since then: a duration back from now (30m, 6h, 7d) "
        "or an ISO 8601 time (default: all stored)."
    ),
]


def _since(value: str | None) -> datetime:
    """``--since`` as an aware time, or a usage error (exit 2)."""
    if value is None:
        return datetime(1970, 1, 1, tzinfo=UTC)
    match = re.fullmatch(r"(\d+)([smhd])", value.strip())
    if match:
        unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[match[2]]
        return datetime.now(UTC) - timedelta(**{unit: int(match[1])})
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        err.print(
            f"--since: want 30m, 6h, 7d or an ISO 8601 time, got {literal(repr(value))}",
            style="red",
        )
        raise typer.Exit(EXIT_USAGE) from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def _eval_reports(workflow: str, variant: str | None, since: str | None) -> list[VariantReport]:
    """The variants' reports for ``eval report`` and ``eval gate``."""
    from oncely.cli.ops import eval_reports

    settings = _settings()
    _workflows(settings, [workflow])
    return _run(eval_reports(settings, workflow, variant, _since(since)))


@eval_app.command("report")
def eval_report(
    workflow: EvalWorkflowOpt,
    variant: Annotated[str | None, typer.Option(help="Only this shadow variant.")] = None,
    since: SinceOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Shadow variants against the primary: agreement, scores, errors, cost and latency."""
    from oncely.cli.ops import print_eval_report

    reports = _eval_reports(workflow, variant, since)
    print_eval_report(reports, workflow=workflow, as_json=as_json)


@eval_app.command("gate")
def eval_gate(
    workflow: EvalWorkflowOpt,
    variant: Annotated[str, typer.Option(help="The shadow variant to judge.")],
    min_agreement: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Least mean agreement over the pairs.")
    ],
    min_pairs: Annotated[int, typer.Option(min=1, help="Least pairs compared.")] = 1,
    max_error_rate: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Most shadow runs failed, as a share.")
    ] = 0.05,
    max_cost_ratio: Annotated[
        float | None,
        typer.Option(min=0.0, help="Most shadow tokens per job over the primary's."),
    ] = None,
    since: SinceOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Exit 0 if the variant meets every threshold, else 1: for deploy pipelines."""
    from oncely.shadow.report import Thresholds, gate

    reports = _eval_reports(workflow, variant, since)
    thresholds = Thresholds(min_agreement, min_pairs, max_error_rate, max_cost_ratio)
    verdict = gate(reports[0] if reports else None, thresholds)
    word = "pass" if verdict.passed else "fail"
    if as_json:
        _print_json(
            {
                "workflow": workflow,
                "variant": variant,
                "passed": verdict.passed,
                "checks": verdict.checks,
                "failures": verdict.failures,
            }
        )
    else:
        details = "; ".join([*verdict.failures, *verdict.checks])
        sys.stdout.write(f"{word}: {literal(workflow)} / {literal(variant)}: {literal(details)}\n")
    if not verdict.passed:
        raise typer.Exit(EXIT_FAILED)


def main() -> None:
    app()

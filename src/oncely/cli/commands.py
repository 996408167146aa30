"""`oncely`: every process and operator command, put together.

The CLI is the composition root's front door: it builds Settings once,
opens pools and clients (``bootstrap``), and hands them to the services.
Each command group lives in a module of its own (``keys.py``,
``jobs.py``, ``shadow_eval.py`` for ``oncely eval``, ...), the processes in
``processes.py``, the fake providers in ``fake_servers.py``, and what they
all run on (settings, exit codes, the shared options) in ``invocation.py``.
The order below is the order ``oncely --help`` lists them in.
"""

from __future__ import annotations

from typing import Annotated

import typer

from oncely.cli import (
    batches,
    dlq,
    fake_servers,
    invocation,
    jobs,
    keys,
    outbox,
    processes,
    schedules,
    shadow_eval,
    tenants,
    usage,
)

# Help is plain text (click's): no type placeholders on flags (`<bool>`),
# and nothing but text when it goes to a file or a pipe.
app = typer.Typer(
    help="oncely: exactly-once effects for LLM steps in business workflows.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
for name, group in (
    ("keys", keys.app),
    ("dlq", dlq.app),
    ("outbox", outbox.app),
    ("tenants", tenants.app),
    ("eval", shadow_eval.app),
    ("usage", usage.app),
    ("batches", batches.app),
    ("schedules", schedules.app),
    ("jobs", jobs.app),
):
    app.add_typer(group, name=name)
for name, command in (
    ("migrate", processes.migrate),
    ("api", processes.api),
    ("worker", processes.worker),
    ("relay", processes.relay),
    ("fake-llm", fake_servers.fake_llm),
    ("fake-mail", fake_servers.fake_mail),
    ("fake-mcp", fake_servers.fake_mcp),
    ("dev", processes.dev),
    ("status", processes.status),
):
    app.command(name)(command)


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
    invocation.set_app(app_spec)


def main() -> None:
    app()

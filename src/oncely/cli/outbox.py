"""``oncely outbox``: list the notifications waiting or failed, and send failed ones again."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from oncely.cli.invocation import (
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    DryRunOpt,
    JsonOpt,
    err,
    load_settings,
    print_json,
    run,
)

app = typer.Typer(help="The outbox: notifications waiting or failed.", no_args_is_help=True)


@app.command("list")
def outbox_list(
    failed: Annotated[bool, typer.Option("--failed", help="Only rows that gave up.")] = False,
    limit: Annotated[int, typer.Option(help="How many rows.")] = 50,
    as_json: JsonOpt = False,
) -> None:
    """List outbox rows not yet sent (or, with --failed, the ones that gave up)."""
    from oncely.cli.ops import show_outbox

    run(show_outbox(load_settings(), failed_only=failed, limit=limit, as_json=as_json))


@app.command("retry")
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
    ids = run(retry_outbox(load_settings(), row_id, dry_run=dry_run))
    if row_id is not None and not ids:
        err.print(f"no failed row {row_id}", style="red")
        raise typer.Exit(EXIT_NOT_FOUND)
    verb = "would schedule" if dry_run else "scheduled"
    if as_json:
        print_json({"dry_run": dry_run, "scheduled": ids})
    else:
        for row in ids:
            sys.stdout.write(f"{verb} outbox row {row}\n")
    err.print(f"{verb} {len(ids)} row(s) for sending")

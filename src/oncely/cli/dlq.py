"""``oncely dlq``: list dead letters and put them back in their streams."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from oncely.cli.invocation import (
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    DryRunOpt,
    JsonOpt,
    OneWorkflowOpt,
    err,
    known_workflows,
    load_settings,
    print_json,
    run,
)
from oncely.cli.terminal import literal

app = typer.Typer(help="Dead letters: inspect and replay.", no_args_is_help=True)


@app.command("list")
def dlq_list(
    limit: Annotated[int, typer.Option(help="How many per workflow, newest first.")] = 50,
    workflow: OneWorkflowOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List dead letters with their workflow, reason, delivery count and last error."""
    from oncely.cli.ops import show_dead_letters

    settings = load_settings()
    known_workflows(settings, [workflow] if workflow else None)
    run(show_dead_letters(settings, limit=limit, workflow=workflow, as_json=as_json))


@app.command("replay")
def dlq_replay(
    dead_id: Annotated[
        str | None, typer.Argument(help="The dead letter's id: its job's id (dlq list).")
    ] = None,
    replay_all: Annotated[bool, typer.Option("--all", help="Replay every dead letter.")] = False,
    workflow: OneWorkflowOpt = None,
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
    settings = load_settings()
    known_workflows(settings, [workflow] if workflow else None)
    replayed = run(replay_dead_letters(settings, dead_id, workflow=workflow, dry_run=dry_run))
    if dead_id is not None and not replayed:
        err.print(f"no dead letter {literal(dead_id)}", style="red")
        raise typer.Exit(EXIT_NOT_FOUND)
    verb = "would replay" if dry_run else "replayed"
    if as_json:
        print_json({"dry_run": dry_run, "replayed": replayed})
    else:
        for item in replayed:
            sys.stdout.write(f"{verb} {item['workflow']} job {item['job_id']}\n")
    err.print(f"{verb} {len(replayed)} dead letter(s)")

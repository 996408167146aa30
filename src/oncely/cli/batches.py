"""``oncely batches``: the batch lane's batches (docs/lanes.md)."""

from __future__ import annotations

import uuid
from typing import Annotated

import typer

from oncely.cli.invocation import EXIT_NOT_FOUND, EXIT_USAGE, JsonOpt, err, load_settings, run
from oncely.cli.terminal import literal

app = typer.Typer(help="The batch lane's batches.", no_args_is_help=True)


@app.command("list")
def batches_list(
    limit: Annotated[int, typer.Option(min=1, max=1000, help="At most this many.")] = 50,
    as_json: JsonOpt = False,
) -> None:
    """The batches, newest first: their lines done and failed, jobs waiting."""
    from oncely.cli.ops import show_batches

    run(show_batches(load_settings(), limit=limit, as_json=as_json))


@app.command("show")
def batches_show(
    batch_id: Annotated[str, typer.Argument(help="The batch's oncely id.")],
    as_json: JsonOpt = False,
) -> None:
    """One batch: its provider id, model, lines done and failed, jobs waiting,
    and each line's custom id with its job and call."""
    from oncely.cli.ops import show_batches

    try:
        parsed = str(uuid.UUID(batch_id))
    except ValueError:
        err.print(f"not a batch id: {literal(repr(batch_id))}", style="red")
        raise typer.Exit(EXIT_USAGE) from None
    if not run(show_batches(load_settings(), batch_id=parsed, as_json=as_json)):
        err.print(f"no batch {parsed}", style="red")
        raise typer.Exit(EXIT_NOT_FOUND)

"""``oncely schedules``: the workflows on a timetable."""

from __future__ import annotations

import typer

from oncely.cli.invocation import JsonOpt, load_settings, run

app = typer.Typer(help="Workflows on a timetable.", no_args_is_help=True)


@app.command("list")
def schedules_list(as_json: JsonOpt = False) -> None:
    """List the scheduled workflows: their timetable, last tick and job, next tick."""
    from oncely.cli.ops import show_schedules

    run(show_schedules(load_settings(), as_json=as_json))

"""``oncely usage``: what model calls cost, from the usage ledger."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, cast

import typer

from oncely.cli.invocation import EXIT_USAGE, JsonOpt, err, load_settings, parse_since, run
from oncely.cli.terminal import literal

if TYPE_CHECKING:
    from oncely.usage.ledger import GroupBy

app = typer.Typer(help="What model calls cost: the usage ledger.", no_args_is_help=True)

GroupByOpt = Annotated[
    str,
    typer.Option("--by", help="Group by tenant, workflow, model, dialect, lane or day (UTC)."),
]


@app.command("report")
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
    """Model calls, tokens, cost, what the provider's cache and the cheaper
    lanes saved, and wasted calls (calls that produced no checkpoint)."""
    from oncely.cli.ops import usage_report as report

    if by not in ("tenant", "workflow", "model", "dialect", "lane", "day"):
        err.print(
            f"--by: want tenant, workflow, model, dialect, lane or day, got {literal(repr(by))}",
            style="red",
        )
        raise typer.Exit(EXIT_USAGE)
    group: GroupBy = cast("GroupBy", by)
    run(report(load_settings(), since=parse_since(since), by=group, as_json=as_json))

"""``oncely tenants``: erase a tenant's data, show its model spend today."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from oncely.cli.invocation import JsonOpt, err, load_settings, parse_tenant, print_json, run
from oncely.cli.terminal import literal

app = typer.Typer(help="Tenants' data.", no_args_is_help=True)


@app.command("erase")
def tenants_erase(
    tenant: Annotated[str, typer.Argument(help="The tenant whose data goes.")],
    as_json: JsonOpt = False,
) -> None:
    """Delete every job, result, outbox row, queued message and API key of a tenant."""
    from oncely.cli.ops import erase_tenant

    parse_tenant(tenant)
    counts = run(erase_tenant(load_settings(), tenant))
    if as_json:
        print_json({"tenant": tenant, "deleted": counts})
        return
    for name, n in counts.items():
        sys.stdout.write(f"{name}: {n}\n")
    err.print(f"erased tenant {literal(tenant)}")


@app.command("usage")
def tenants_usage(
    tenant: Annotated[str, typer.Argument(help="The tenant.")],
    as_json: JsonOpt = False,
) -> None:
    """Today's model spend of a tenant (UTC): tokens, cost, calls, against its budgets."""
    from oncely.cli.ops import tenant_usage

    parse_tenant(tenant)
    run(tenant_usage(load_settings(), tenant, as_json=as_json))

"""``oncely keys``: create, list and revoke API keys (a bearer token per tenant)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from oncely.cli.invocation import (
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    JsonOpt,
    err,
    load_settings,
    parse_tenant,
    print_json,
    run,
)
from oncely.cli.terminal import literal

app = typer.Typer(help="API keys: a bearer token per tenant.", no_args_is_help=True)


@app.command("create")
def keys_create(
    tenant: Annotated[str, typer.Option(help="The tenant this key acts for.")],
    as_json: JsonOpt = False,
) -> None:
    """Create an API key. Prints the key alone on stdout, once; only its hash is stored."""
    from oncely.cli.ops import create_key

    parse_tenant(tenant, "--tenant", new=True)
    key, key_id = run(create_key(load_settings(), tenant))
    err.print(f"created key {key_id} for tenant {literal(tenant)}; it is shown only now")
    if as_json:
        print_json({"id": key_id, "tenant": tenant, "key": key})
    else:
        sys.stdout.write(key + "\n")


@app.command("list")
def keys_list(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's keys.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List API keys: id, tenant, created, last used, revoked (never the secret)."""
    from oncely.cli.ops import show_keys

    run(show_keys(load_settings(), tenant=tenant, as_json=as_json))


@app.command("revoke")
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
    tenant = run(revoke_key(load_settings(), key=key, key_id=key_id))
    if tenant is None:
        err.print("no such active key", style="red")
        raise typer.Exit(EXIT_NOT_FOUND)
    if as_json:
        print_json({"revoked": key_id or "by key", "tenant": tenant})
    err.print(
        f"revoked a key of tenant {literal(tenant)}; every API process refuses it within"
        " about a second (within ONCELY_API_KEY_CACHE_S if Redis did not answer)"
    )

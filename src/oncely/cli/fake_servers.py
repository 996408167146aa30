"""``oncely fake-llm``, ``fake-mail`` and ``fake-mcp``: the fake providers
(``oncely.fakes``) served as processes, their random faults from ``--faults``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from pathlib import Path
from typing import Annotated, Any

import typer

from oncely.cli.invocation import HostOpt, PortOpt, load_settings, require_port, run

SeedOpt = Annotated[
    int, typer.Option(envvar="ONCELY_FAKE_SEED", show_envvar=True, help="Seed for random faults.")
]
SlowOpt = Annotated[
    float,
    typer.Option(envvar="ONCELY_FAKE_SLOW_S", show_envvar=True, help="How long a slow call takes."),
]
BatchDelayOpt = Annotated[
    float,
    typer.Option(
        "--batch-delay",
        envvar="ONCELY_FAKE_BATCH_DELAY_S",
        show_envvar=True,
        min=0.0,
        help="How long a batch (the Batches API) takes to answer.",
    ),
]
RpmOpt = Annotated[
    int, typer.Option(envvar="ONCELY_FAKE_RPM", show_envvar=True, help="Requests/min, then 429.")
]
TpmOpt = Annotated[
    int, typer.Option(envvar="ONCELY_FAKE_TPM", show_envvar=True, help="Tokens/min, then 429.")
]
FaultRateOpt = Annotated[
    float,
    typer.Option(
        envvar="ONCELY_FAKE_FAULT_RATE",
        show_envvar=True,
        min=0.0,
        max=1.0,
        help="Share of calls failing at random (half 429, half 503).",
    ),
]
LlmFaultsOpt = Annotated[
    str,
    typer.Option(
        envvar="ONCELY_FAKE_LLM_FAULTS",
        show_envvar=True,
        help="Random faults per call, kind=rate: 429, 503, hang, drip, slow, badjson "
        "(e.g. 429=0.05,503=0.05,slow=0.05).",
    ),
]


def fake_llm(
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8101,
    rpm: RpmOpt = 0,
    tpm: TpmOpt = 0,
    fault_rate: FaultRateOpt = 0.0,
    seed: SeedOpt = 0,
    faults: LlmFaultsOpt = "",
    slow_s: SlowOpt = 2.0,
    batch_delay_s: BatchDelayOpt = 1.0,
) -> None:
    """Serve the fake OpenAI-compatible model; directives in the prompt script its faults."""
    from oncely.fakes.llm import RANDOM_FAULTS, serve_fake_llm

    rates = _fault_rates(faults, RANDOM_FAULTS)
    load_settings(find_dev=False, app=False)
    require_port(host, port)
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
            batch_delay_s=batch_delay_s,
        )
    )


MailboxOpt = Annotated[
    Path | None,
    typer.Option(
        envvar="ONCELY_FAKE_MAILBOX", show_envvar=True, help="Append every email to this JSONL."
    ),
]
MailFaultsOpt = Annotated[
    str,
    typer.Option(
        envvar="ONCELY_FAKE_MAIL_FAULTS",
        show_envvar=True,
        help="Random faults per POST, kind=rate: 503, timeout (held past the sender's "
        "timeout), drop (delivered, then the connection closed unanswered).",
    ),
]
HoldOpt = Annotated[
    float,
    typer.Option(
        envvar="ONCELY_FAKE_HOLD_S", show_envvar=True, help="How long a timeout holds a POST."
    ),
]


def fake_mail(
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8102,
    mailbox: MailboxOpt = None,
    faults: MailFaultsOpt = "",
    seed: SeedOpt = 0,
    hold_s: HoldOpt = 30.0,
) -> None:
    """Serve the fake mail and webhook provider (dedupes on Idempotency-Key / webhook-id)."""
    from oncely.fakes.mail import RANDOM_FAULTS, serve_fake_mail

    rates = _fault_rates(faults, RANDOM_FAULTS)
    load_settings(find_dev=False, app=False)
    require_port(host, port)
    _serve_forever(serve_fake_mail(host, port, mailbox, faults=rates, seed=seed, hold_s=hold_s))


IdempotentOpt = Annotated[
    bool,
    typer.Option(
        envvar="ONCELY_FAKE_MCP_IDEMPOTENT",
        show_envvar=True,
        help="Declare experimental io.oncely/idempotency and dedupe refunds on the key.",
    ),
]
TokenOpt = Annotated[
    str | None,
    typer.Option(
        envvar="ONCELY_FAKE_MCP_TOKEN",
        show_envvar=True,
        help="Answer 401 to requests without Authorization: Bearer TOKEN.",
    ),
]


def fake_mcp(
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8103,
    idempotent: IdempotentOpt = False,
    token: TokenOpt = None,
    slow_s: SlowOpt = 2.0,
) -> None:
    """Serve the fake MCP server (streamable HTTP at /mcp): lookup_order and refund,
    [[fake:...]] faults in arguments, calls counted per key at GET /_calls."""
    from oncely.fakes.mcp import serve_fake_mcp

    load_settings(find_dev=False, app=False)
    require_port(host, port)
    _serve_forever(serve_fake_mcp(host, port, idempotent=idempotent, slow_s=slow_s, token=token))


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

    run(main())

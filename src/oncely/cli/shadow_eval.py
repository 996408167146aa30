"""``oncely eval``: shadow runs (ONCELY_SHADOW) against the primary, as a
report or as a promotion gate for deploy pipelines."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

import typer

from oncely.cli.invocation import (
    EXIT_FAILED,
    JsonOpt,
    known_workflows,
    load_settings,
    parse_since,
    print_json,
    run,
)
from oncely.cli.terminal import literal

if TYPE_CHECKING:
    from oncely.shadow.report import VariantReport

app = typer.Typer(
    help="Shadow runs (ONCELY_SHADOW): agreement reports and promotion gates.",
    no_args_is_help=True,
)

EvalWorkflowOpt = Annotated[str, typer.Option("--workflow", "-w", help="The workflow.")]
SinceOpt = Annotated[
    str | None,
    typer.Option(
        help="Only shadow runs since then: a duration back from now (30m, 6h, 7d) "
        "or an ISO 8601 time (default: all stored)."
    ),
]


def _eval_reports(workflow: str, variant: str | None, since: str | None) -> list[VariantReport]:
    """The variants' reports for ``eval report`` and ``eval gate``."""
    from oncely.cli.ops import eval_reports

    settings = load_settings()
    known_workflows(settings, [workflow])
    return run(eval_reports(settings, workflow, variant, parse_since(since)))


@app.command("report")
def eval_report(
    workflow: EvalWorkflowOpt,
    variant: Annotated[str | None, typer.Option(help="Only this shadow variant.")] = None,
    since: SinceOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Shadow variants against the primary: agreement, scores, errors, cost and latency."""
    from oncely.cli.ops import print_eval_report

    reports = _eval_reports(workflow, variant, since)
    print_eval_report(reports, workflow=workflow, variant=variant, as_json=as_json)


@app.command("gate")
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
        print_json(
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

"""``oncely jobs``: one job in detail, the jobs of a workflow or status, and
what an operator does to one: cancel it, decide a call it waits on, rerun it
from a checkpoint."""

from __future__ import annotations

import json
import sys
import uuid
from typing import TYPE_CHECKING, Annotated, Any

import typer

from oncely.cli.invocation import (
    EXIT_FAILED,
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    DryRunOpt,
    JsonOpt,
    OneWorkflowOpt,
    err,
    known_workflows,
    load_settings,
    parse_job_id,
    print_json,
    run,
)
from oncely.cli.terminal import literal

if TYPE_CHECKING:
    from oncely.jobs.checkpoints import EventOutcome

app = typer.Typer(
    help="Jobs: one in detail, cancel one, rerun one from a checkpoint.", no_args_is_help=True
)

JobIdArg = Annotated[str, typer.Argument(help="The job's id.")]


@app.command("show")
def jobs_show(
    job_id: JobIdArg,
    workflow: OneWorkflowOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """A job: request, result, usage, error, checkpoints (with values), what it
    waits for, deliveries, its message now, outbox rows."""
    from oncely.cli.ops import show_job

    parsed = parse_job_id(job_id)
    settings = load_settings()
    known_workflows(settings, [workflow] if workflow else None)
    if not run(show_job(settings, parsed, workflow=workflow, as_json=as_json)):
        err.print(
            f"no job {parsed}" + (f" in {literal(workflow)}" if workflow else ""), style="red"
        )
        raise typer.Exit(EXIT_NOT_FOUND)


@app.command("cancel")
def jobs_cancel(
    job_id: JobIdArg,
    workflow: OneWorkflowOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Cancel a queued, running or waiting job: nothing more is written for it.
    Exit 1 if it is already done or dead, 3 if there is no such job."""
    from oncely.cli.ops import cancel_job

    parsed = parse_job_id(job_id)
    settings = load_settings()
    known_workflows(settings, [workflow] if workflow else None)
    found = run(cancel_job(settings, parsed, workflow=workflow))
    if found is None:
        err.print(
            f"no job {parsed}" + (f" in {literal(workflow)}" if workflow else ""), style="red"
        )
        raise typer.Exit(EXIT_NOT_FOUND)
    status = found.status if found.finished else "cancelled"
    if as_json:
        print_json({"job_id": str(parsed), "workflow": found.kind, "status": status})
    else:
        sys.stdout.write(f"{parsed} {status}\n")
    if found.finished:
        err.print(f"the job is {found.status}: nothing to cancel", style="red")
        raise typer.Exit(EXIT_FAILED)


@app.command("approve")
def jobs_approve(
    job_id: JobIdArg,
    call_id: Annotated[str, typer.Argument(help="The tool call it waits on (jobs show).")],
    reject: Annotated[bool, typer.Option("--reject", help="Reject it instead.")] = False,
    reason: Annotated[str | None, typer.Option("--reason", help="Why (the model is told).")] = None,
    arguments: Annotated[
        str | None, typer.Option("--arguments", help="Edited arguments, as a JSON object.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Approve (or --reject) a tool call an agent's job waits on: the job
    resumes. Exit 1 if it was decided otherwise before or the job is
    finished, 3 if there is no such job or pending call."""
    from oncely.cli.ops import decide_call
    from oncely.jobs.approvals import ArgumentsRefused

    parsed = parse_job_id(job_id)
    decision: dict[str, Any] = {"approved": not reject}
    if reason is not None:
        decision["reason"] = reason
    if arguments is not None and reject:
        err.print("--arguments edits what an approval runs; a rejection runs nothing", style="red")
        raise typer.Exit(EXIT_USAGE)
    if arguments is not None:
        try:
            edited = json.loads(arguments)
        except ValueError:
            edited = None
        if not isinstance(edited, dict):
            err.print("--arguments must be a JSON object", style="red")
            raise typer.Exit(EXIT_USAGE)
        decision["arguments"] = edited
    try:
        outcome = run(decide_call(load_settings(), parsed, call_id, decision))
    except ArgumentsRefused as exc:
        where = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors[:5]
        )
        err.print(f"--arguments: not what the tool takes: {literal(where)}", style="red")
        raise typer.Exit(EXIT_USAGE) from None
    _decided(parsed, call_id, outcome, "rejected" if reject else "approved", as_json)


@app.command("resolve")
def jobs_resolve(
    job_id: JobIdArg,
    call_id: Annotated[str, typer.Argument(help="The uncertain call it waits on (jobs show).")],
    resend: Annotated[
        bool, typer.Option("--resend", help="It did not happen: run it again.")
    ] = False,
    result: Annotated[
        str | None, typer.Option("--result", help="It happened, with this result (JSON).")
    ] = None,
    failed: Annotated[
        str | None, typer.Option("--failed", help="It failed, for this reason.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Say what became of an at-most-once call whose outcome is unknown (its
    worker died mid-call): exactly one of --resend, --result or --failed.
    The job resumes. Exit 1 if it was decided otherwise before or the job is
    finished, 3 if there is no such job or pending call."""
    from oncely.cli.ops import decide_call

    parsed = parse_job_id(job_id)
    chosen = [name for name, given in (("resend", resend), ("result", result is not None),
                                       ("failed", failed is not None)) if given]  # fmt: skip
    if len(chosen) != 1:
        err.print("give exactly one of --resend, --result or --failed", style="red")
        raise typer.Exit(EXIT_USAGE)
    decision: dict[str, Any] = {"resend": True} if resend else {}
    if failed is not None:
        decision["failed"] = failed
    if result is not None:
        try:
            decision["result"] = json.loads(result)
        except ValueError:
            err.print("--result must be JSON", style="red")
            raise typer.Exit(EXIT_USAGE) from None
    outcome = run(decide_call(load_settings(), parsed, call_id, decision, on="uncertain"))
    _decided(parsed, call_id, outcome, chosen[0], as_json)


def _decided(
    job_id: uuid.UUID, call_id: str, outcome: EventOutcome | None, status: str, as_json: bool
) -> None:
    """What ``jobs approve`` and ``jobs resolve`` say of a decision."""
    if outcome is None or outcome.outcome == "missing":
        err.print(f"no job {job_id} waiting on call {literal(repr(call_id))}", style="red")
        raise typer.Exit(EXIT_NOT_FOUND)
    if outcome.outcome in ("conflict", "finished"):
        why = (
            "it was decided otherwise before"
            if outcome.outcome == "conflict"
            else (f"the job is {outcome.status}")
        )
        err.print(f"not decided: {why}", style="red")
        raise typer.Exit(EXIT_FAILED)
    if as_json:
        print_json({"job_id": str(job_id), "call_id": call_id, "status": status})
    else:
        sys.stdout.write(f"{job_id} {call_id} {status}\n")


@app.command("list")
def jobs_list(
    workflow: OneWorkflowOpt = None,
    status: Annotated[
        str | None, typer.Option("--status", help="queued, waiting, done, dead or cancelled.")
    ] = None,
    reason: Annotated[
        str | None,
        typer.Option("--reason", help="A dead job's reason (nondeterministic, max_age, ...)."),
    ] = None,
    parent: Annotated[
        str | None, typer.Option("--parent", help="Only the child jobs of this job's maps.")
    ] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, max=10_000)] = 100,
    as_json: JsonOpt = False,
) -> None:
    """Jobs newest first, of any tenant: of a workflow, a status, a dead reason, a parent."""
    from oncely.cli.ops import list_jobs, print_jobs

    settings = load_settings()
    known_workflows(settings, [workflow] if workflow else None)
    found = run(
        list_jobs(
            settings,
            workflow=workflow,
            status=status,
            reason=reason,
            limit=limit,
            parent=None if parent is None else parse_job_id(parent),
        )
    )
    print_jobs(found, as_json=as_json)


ToOpt = Annotated[
    str | None,
    typer.Option(
        "--to",
        help="The checkpoint to run again from (jobs show lists them): it and "
        "every later one are deleted.",
    ),
]
AllNondeterministicOpt = Annotated[
    bool,
    typer.Option(
        "--all-nondeterministic",
        help="Every job dead as nondeterministic (a deploy changed its step).",
    ),
]
ToLastMatchOpt = Annotated[
    bool,
    typer.Option(
        "--to-last-match",
        help="With --all-nondeterministic: rerun each from its first checkpoint "
        "that no longer matches the code, keeping the ones that do.",
    ),
]


@app.command("rewind")
def jobs_rewind(
    job_id: Annotated[str | None, typer.Argument(help="The job's id (dead or cancelled).")] = None,
    to: ToOpt = None,
    all_nondeterministic: AllNondeterministicOpt = False,
    to_last_match: ToLastMatchOpt = False,
    dry_run: DryRunOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Rerun a dead or cancelled job from a checkpoint, or every job a deploy
    made nondeterministic. Effects it emits again keep their dedupe keys, so
    one already sent is not sent again. Exit 1 if the job is not dead or
    cancelled, 3 if the job or the checkpoint is unknown."""
    if all_nondeterministic:
        if job_id is not None or to is not None or not to_last_match:
            err.print(
                "--all-nondeterministic goes with --to-last-match, no job id or --to", style="red"
            )
            raise typer.Exit(EXIT_USAGE)
        _rewind_nondeterministic(dry_run=dry_run, as_json=as_json)
        return
    if job_id is None or to is None or to_last_match or dry_run:
        err.print(
            "give a job id and --to KEY (or --all-nondeterministic --to-last-match)", style="red"
        )
        raise typer.Exit(EXIT_USAGE)
    _rewind_one(parse_job_id(job_id), to, as_json=as_json)


def _rewind_one(parsed: uuid.UUID, to: str, *, as_json: bool) -> None:
    from oncely.cli.ops import checkpoint_keys, rewind_job

    settings = load_settings()
    rewound = run(rewind_job(settings, parsed, to))
    if rewound is None:
        err.print(f"no job {parsed}", style="red")
        raise typer.Exit(EXIT_NOT_FOUND)
    if rewound.status not in ("dead", "cancelled"):
        err.print(f"the job is {rewound.status}: only dead or cancelled jobs rewind", style="red")
        raise typer.Exit(EXIT_FAILED)
    if not rewound.deleted:
        keys = run(checkpoint_keys(settings, parsed))
        err.print(f"no checkpoint {literal(repr(to))}; the job has {keys}", style="red")
        raise typer.Exit(EXIT_NOT_FOUND)
    if as_json:
        print_json({"job_id": str(parsed), "status": "queued", "deleted": rewound.deleted})
    else:
        sys.stdout.write(f"{parsed} queued; deleted {', '.join(rewound.deleted)}\n")


def _rewind_nondeterministic(*, dry_run: bool, as_json: bool) -> None:
    from oncely.cli.ops import rewind_nondeterministic

    done = run(rewind_nondeterministic(load_settings(), limit=10_000, dry_run=dry_run))
    verb = "would rerun" if dry_run else "queued"
    if as_json:
        print_json({"dry_run": dry_run, "jobs": [{"job_id": j, "from": key} for j, key, _ in done]})
    else:
        for job, key, _ in done:
            sys.stdout.write(f"{job} {verb} from {key}\n")
    err.print(f"{verb} {len(done)} job(s)")

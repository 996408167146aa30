"""The console's pages and its write actions (replay, retry, sign out).

Every page depends on ``Console.signed_in``, which sends a stranger to the
login form (console/session.py); a page of one workflow, or of one job, on
``Console.workflow`` or ``Console.job``, which answer 404 for one the app
does not have. Reads only read; the write actions are POSTs depending on
``Console.checked``: the session's CSRF token, or 403. Each is idempotent
(a second replay or retry finds nothing to do and says so). A dependency
that refuses raises ``Refused`` with its answer, which ``mount_console``
has the app send as it is. Pages load no inline script or style: their one
script and stylesheet are served from ``/console/assets``, and the CSP
allows nothing else.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from importlib import resources
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import parse_qs, urlencode

import structlog
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup
from pydantic import ValidationError

from oncely.api.streaming import EVENT_STREAM, JobStream, resume_after
from oncely.console.session import COOKIE, SESSION_S, ConsoleKey, Sessions
from oncely.decisions import UncertainDecision, is_call_id
from oncely.jobs import approvals, dead_letters
from oncely.jobs.checkpoints import Checkpoints
from oncely.jobs.inspection import UNREPORTED_NOTE, inspect_job
from oncely.jobs.store import Jobs
from oncely.outbox.store import OutboxStore
from oncely.shown import literal
from oncely.statuses import FINISHED, ROW_STATUSES
from oncely.usage import ledger
from oncely.views import pending_approval, pending_uncertain, waited_on

if TYPE_CHECKING:
    from oncely.api.clients import Host

log = structlog.get_logger("oncely.console")

STATUSES = ROW_STATUSES
# Read pages reload themselves this often while open.
REFRESH_S = 10
_LIST_LIMIT = 100
_HEADERS = {
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": (
        "default-src 'none'; img-src data:; style-src 'self'; script-src 'self'; "
        "connect-src 'self'; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
}
# The console's own files, served as they are.
_ASSETS = {"console.css": "text/css; charset=utf-8", "console.js": "text/javascript; charset=utf-8"}


def _templates() -> Environment:
    env = Environment(
        loader=PackageLoader("oncely.console", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        finalize=_shown,
    )
    env.filters["pretty"] = lambda v: json.dumps(v, indent=2, sort_keys=True, ensure_ascii=False)
    env.filters["when"] = _when
    return env


def _shown(value: object) -> object:
    """Every text a page shows, with its invisible and direction-changing
    characters as visible escapes (``oncely.cli.terminal.literal``; line breaks
    kept), so that stored text cannot disguise itself; markup the page's own
    filters made is left as it is."""
    if isinstance(value, str) and not isinstance(value, Markup):
        return literal(value, keep="\n\t")
    return value


def _when(value: datetime | float | None) -> str:
    if value is None:
        return "—"
    if isinstance(value, float | int):
        value = datetime.fromtimestamp(value, UTC)
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


class Refused(Exception):
    """A page's dependency answered for it: sign in first, 403, 404."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


async def _answer(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, Refused)
    return exc.response


class Console:
    """What every page needs: the API's clients, the key and the templates,
    and the dependencies that admit a request to a page."""

    def __init__(self, api: Host, key: str) -> None:
        self.api = api
        self.key = ConsoleKey(key)
        self.templates = _templates()
        self.workflows = [w.name for w in api.app]

    @property
    def sessions(self) -> Sessions:
        return Sessions(self.api.clients.redis, self.key)

    @property
    def jobs(self) -> Jobs:
        return self.api.jobs

    @property
    def outbox(self) -> OutboxStore:
        return OutboxStore(self.api.clients.pool)

    async def session(self, request: Request) -> str | None:
        """The request's session, while it lasts (looked up once per
        request, however many of its dependencies ask)."""
        if "console_session" not in request.scope:
            found = await self.sessions.current(request.cookies.get(COOKIE))
            request.scope["console_session"] = found
        session: str | None = request.scope["console_session"]
        return session

    # -- dependencies ----------------------------------------------------------

    async def signed_in(self, request: Request) -> str:
        """The request's session; none: off to the login form."""
        session = await self.session(request)
        if session is None:
            raise Refused(_to_login())
        return session

    async def checked(self, request: Request) -> str:
        """A write's session, its form carrying the session's CSRF token."""
        session = await self.signed_in(request)
        if not self.key.csrf_ok(session, (await _form(request)).get("csrf")):
            raise Refused(self.page("forbidden.html", session, http_status=403))
        return session

    async def workflow(self, request: Request, workflow: str) -> str:
        """A workflow of the app (its session checked first), else 404."""
        session = await self.signed_in(request)
        if workflow not in self.workflows:
            raise Refused(self.not_found("workflow", session))
        return workflow

    async def job(self, request: Request, workflow: str, job_id: str) -> uuid.UUID:
        """A job id under a workflow of the app (the session checked
        first), else 404; whether the job exists is the page's to find."""
        session = await self.signed_in(request)
        try:
            parsed = uuid.UUID(job_id)
        except ValueError:
            raise Refused(self.not_found("job", session)) from None
        if workflow not in self.workflows:
            raise Refused(self.not_found("job", session))
        return parsed

    def page(
        self,
        name: str,
        session: str | None,
        http_status: int = 200,
        headers: dict[str, str] | None = None,
        **context: Any,
    ) -> HTMLResponse:
        csrf = self.key.csrf_token(session) if session is not None else None
        body = self.templates.get_template(name).render(
            workflows=self.workflows, csrf=csrf, **context
        )
        return HTMLResponse(body, status_code=http_status, headers={**_HEADERS, **(headers or {})})

    def not_found(self, what: str, session: str | None) -> HTMLResponse:
        return self.page("missing.html", session, http_status=404, what=what)


def _to_login() -> RedirectResponse:
    return RedirectResponse("/console/login", status_code=303)


def _redirect(path: str, **query: str) -> RedirectResponse:
    return RedirectResponse(f"{path}?{urlencode(query)}" if query else path, status_code=303)


async def _form(request: Request) -> dict[str, str]:
    fields = parse_qs((await request.body()).decode("utf-8", "replace"))
    return {name: values[0] for name, values in fields.items()}


def mount_console(app: FastAPI, api: Host, key: str) -> None:
    """Serve the console at /console on ``app`` (the composition root's
    call: the API knows nothing of it), behind ``key``."""
    app.include_router(console_router(api, key))
    app.add_exception_handler(Refused, _answer)


def console_router(api: Host, key: str) -> APIRouter:
    """The console's routes under /console for ``api``'s app, behind ``key``;
    ``mount_console`` serves them with their refusals."""
    console = Console(api, key)
    router = APIRouter(prefix="/console", include_in_schema=False)
    _add_assets(router)
    _add_login(router, console)
    _add_overview(router, console)
    _add_jobs(router, console)
    _add_job_page(router, console)
    _add_approvals(router, console)
    _add_live(router, console)
    _add_dead_letters(router, console)
    _add_usage(router, console)
    _add_outbox(router, console)
    return router


def _add_assets(router: APIRouter) -> None:
    files = resources.files(__package__).joinpath("assets")

    @router.get("/assets/{name}")
    async def asset(name: str) -> Response:
        if name not in _ASSETS:
            return Response(status_code=404)
        headers = {"Cache-Control": "max-age=3600"}
        return Response(
            files.joinpath(name).read_bytes(), media_type=_ASSETS[name], headers=headers
        )


def _add_login(router: APIRouter, console: Console) -> None:
    @router.get("/login")
    async def login_page(request: Request, signed_out: str = "") -> Response:
        return console.page("login.html", None, signed_out=bool(signed_out))

    @router.post("/login")
    async def login(request: Request) -> Response:
        client = _client(request)
        sessions = console.sessions
        wait_s = await sessions.refused(client)
        if wait_s:
            log.warning("console.login_throttled", client=client, retry_after_s=wait_s)
            headers = {"Retry-After": str(wait_s)}
            return console.page(
                "login.html", None, 429, headers, throttled=True, retry_after=wait_s
            )
        if not console.key.matches((await _form(request)).get("key", "")):
            await sessions.failed(client)
            log.warning("console.login_refused", client=client)
            return console.page("login.html", None, http_status=401, refused=True)
        session = await sessions.start()
        log.info("console.signed_in", client=client)
        response = RedirectResponse("/console", status_code=303)
        response.set_cookie(
            COOKIE,
            session,
            max_age=SESSION_S,
            path="/console",
            httponly=True,
            samesite="strict",
            # Behind a TLS proxy: see ONCELY_FORWARDED_ALLOW_IPS (docs/console.md).
            secure=request.url.scheme == "https",
        )
        return response

    @router.post("/logout")
    async def logout(request: Request, session: str = Depends(console.checked)) -> Response:
        await console.sessions.end(session)
        log.info("console.signed_out", client=_client(request))
        response = _redirect("/console/login", signed_out="1")
        response.delete_cookie(COOKIE, path="/console", httponly=True, samesite="strict")
        return response


def _client(request: Request) -> str:
    """The client's address (the forwarded one, from a trusted proxy)."""
    return request.client.host if request.client is not None else "unknown"


def _add_overview(router: APIRouter, console: Console) -> None:
    @router.get("")
    async def overview(session: str = Depends(console.signed_in)) -> Response:
        counts = await console.jobs.counts()
        streams = console.jobs.streams
        rows = [
            (name, counts.get(name, dict.fromkeys(STATUSES, 0)), await streams[name].stats())
            for name in console.workflows
        ]
        outbox = await console.outbox.counts()
        return console.page(
            "overview.html", session, refresh=REFRESH_S, rows=rows, outbox=outbox, statuses=STATUSES
        )


def _add_jobs(router: APIRouter, console: Console) -> None:
    @router.get("/workflows/{workflow}/jobs")
    async def job_list(
        status: str = "",
        parent: str = "",
        session: str = Depends(console.signed_in),
        workflow: str = Depends(console.workflow),
    ) -> Response:
        chosen = status if status in STATUSES else None
        try:
            parent_id = uuid.UUID(parent) if parent else None
        except ValueError:
            return console.not_found("job", session)
        jobs = await console.jobs.recent(workflow, chosen, _LIST_LIMIT, parent=parent_id)
        return console.page(
            "jobs.html",
            session,
            refresh=REFRESH_S,
            workflow=workflow,
            jobs=jobs,
            status=chosen,
            statuses=STATUSES,
            parent=parent_id,
        )


def _add_job_page(router: APIRouter, console: Console) -> None:
    @router.get("/workflows/{workflow}/jobs/{job_id}")
    async def job_page(
        workflow: str,
        decided: str = "",
        session: str = Depends(console.signed_in),
        parsed: uuid.UUID = Depends(console.job),
    ) -> Response:
        view = await inspect_job(console.jobs, console.outbox, workflow, parsed)
        if view is None:
            return console.not_found("job", session)
        # An unfinished job's page follows its live stream (console.js); a
        # finished one has nothing left to change.
        unfinished = view.job.status not in FINISHED
        parent = None
        if view.job.parent_id is not None:
            parent = await console.jobs.detail(None, view.job.parent_id)
        return console.page(
            "job.html",
            session,
            refresh=None,
            live=unfinished,
            status=view.status,
            workflow=workflow,
            job=view.job,
            deliveries=view.deliveries,
            whereabouts=view.whereabouts,
            unreported_note=UNREPORTED_NOTE,
            outbox=view.outbox,
            checkpoints=view.checkpoints,
            waited_on=waited_on(view.job),
            approval=pending_approval(view.job),
            uncertain=pending_uncertain(view.job),
            decided=decided,
            parent=parent,
            maps=view.maps,
            usage=view.usage,
        )


def _add_live(router: APIRouter, console: Console) -> None:
    @router.get("/workflows/{workflow}/jobs/{job_id}/stream")
    async def job_stream(request: Request, workflow: str, job_id: str) -> Response:
        """The job's live stream for its page (the page's script follows it)."""
        session = await console.session(request)
        if session is None:
            return Response(status_code=401)
        try:
            parsed = uuid.UUID(job_id)
        except ValueError:
            return Response(status_code=404)
        record = (
            await console.jobs.detail(workflow, parsed) if workflow in console.workflows else None
        )
        if record is None:
            return Response(status_code=404)
        declared = console.api.app[workflow]
        stream = JobStream(console.api.live, declared, console.jobs, record.tenant, parsed)
        try:
            after = resume_after(request.headers.get("last-event-id"))
        except HTTPException:
            return Response(status_code=400)
        return StreamingResponse(
            stream.events(after), media_type=EVENT_STREAM, headers={"Cache-Control": "no-store"}
        )


def _add_approvals(router: APIRouter, console: Console) -> None:
    @router.post("/workflows/{workflow}/jobs/{job_id}/approvals/{call_id}")
    async def decide_call(
        request: Request,
        workflow: str,
        job_id: str,
        call_id: str,
        _: str = Depends(console.checked),
        parsed: uuid.UUID = Depends(console.job),
    ) -> Response:
        form = await _form(request)
        decision: dict[str, Any] = {"approved": form.get("decision") == "approve"}
        if form.get("reason"):
            decision["reason"] = form["reason"]
        state = "approved" if decision["approved"] else "rejected"
        return await _decide(console, workflow, parsed, call_id, decision, "approval", state)

    @router.post("/workflows/{workflow}/jobs/{job_id}/uncertain/{call_id}")
    async def resolve_call(
        request: Request,
        workflow: str,
        job_id: str,
        call_id: str,
        _: str = Depends(console.checked),
        parsed: uuid.UUID = Depends(console.job),
    ) -> Response:
        form = await _form(request)
        chosen = form.get("decision", "")
        given: dict[str, Any] = {
            "resend": {"resend": True},
            "result": {"result": _json_or_text(form.get("result", ""))},
            "failed": {"failed": form.get("reason") or "failed, a person said"},
        }.get(chosen, {})
        try:
            decision = UncertainDecision.model_validate(given).model_dump(
                mode="json", exclude_unset=True
            )
        except ValidationError:
            return _redirect(f"/console/workflows/{workflow}/jobs/{parsed}", decided="invalid")
        return await _decide(console, workflow, parsed, call_id, decision, "uncertain", chosen)


async def _decide(
    console: Console,
    workflow: str,
    job_id: uuid.UUID,
    call_id: str,
    decision: dict[str, Any],
    on: Literal["approval", "uncertain"],
    state: str,
) -> Response:
    """Store a person's decision from the console, and show the job again."""
    if not is_call_id(call_id):
        # Only ids oncely made name a call: nothing else reaches a decision.
        return Response(status_code=404)
    outcome = await approvals.decide(
        Checkpoints(console.jobs), job_id, call_id, decision, by="console", kind=workflow, on=on
    )
    if outcome is not None and outcome.resumed is not None:
        await console.jobs.restore(outcome.resumed)
    found = outcome is not None and outcome.outcome in ("received", "duplicate")
    log.info("console.call_decided", job_id=str(job_id), on=on, decided=found)
    return _redirect(
        f"/console/workflows/{workflow}/jobs/{job_id}", decided=state if found else "not-pending"
    )


def _json_or_text(text: str) -> Any:
    """A result typed into the console: JSON when it is, else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _add_dead_letters(router: APIRouter, console: Console) -> None:
    @router.get("/workflows/{workflow}/dead-letters")
    async def dead_letter_list(
        replayed: str = "",
        missing: str = "",
        session: str = Depends(console.signed_in),
        workflow: str = Depends(console.workflow),
    ) -> Response:
        letters = await dead_letters.list_dead(console.jobs, workflow, _LIST_LIMIT)
        return console.page(
            "dead_letters.html",
            session,
            refresh=REFRESH_S,
            workflow=workflow,
            letters=letters,
            replayed=replayed,
            missing=missing,
        )

    @router.post("/workflows/{workflow}/dead-letters/{dead_id}/replay")
    async def replay(
        dead_id: str,
        _: str = Depends(console.checked),
        workflow: str = Depends(console.workflow),
    ) -> Response:
        job = await dead_letters.replay(console.jobs, workflow, dead_id)
        path = f"/console/workflows/{workflow}/dead-letters"
        if job is None:
            return _redirect(path, missing=dead_id)
        return _redirect(path, replayed=job.job_id)


def _add_outbox(router: APIRouter, console: Console) -> None:
    @router.get("/outbox")
    async def failed_outbox(
        retried: str = "", missing: str = "", session: str = Depends(console.signed_in)
    ) -> Response:
        rows = await console.outbox.list(failed_only=True, limit=_LIST_LIMIT)
        return console.page(
            "outbox.html", session, refresh=REFRESH_S, rows=rows, retried=retried, missing=missing
        )

    @router.post("/outbox/{row_id}/retry")
    async def retry(row_id: int, _: str = Depends(console.checked)) -> Response:
        if not await console.outbox.retry(row_id):
            return _redirect("/console/outbox", missing=str(row_id))
        log.info("console.outbox_retried", outbox_id=row_id)
        return _redirect("/console/outbox", retried=str(row_id))


# The periods the usage page offers.
_USAGE_PERIODS = {"1h": timedelta(hours=1), "24h": timedelta(days=1), "7d": timedelta(days=7)}


def _add_usage(router: APIRouter, console: Console) -> None:
    @router.get("/usage")
    async def usage(since: str = "24h", session: str = Depends(console.signed_in)) -> Response:
        period = since if since in _USAGE_PERIODS else "24h"
        start = datetime.now(UTC) - _USAGE_PERIODS[period]
        found = await ledger.usage_report(
            console.api.clients.pool, since=start, by="workflow/dialect/model"
        )
        # Model names may hold slashes; workflow and dialect names do not.
        rows = [(*row.group.split("/", 2), row) for row in found]
        priced = [row.cache_saved_usd for row in found if row.cache_saved_usd is not None]
        # Spend and savings by lane (docs/lanes.md).
        lanes = await ledger.usage_report(console.api.clients.pool, since=start, by="lane")
        return console.page(
            "usage.html",
            session,
            rows=rows,
            period=period,
            periods=list(_USAGE_PERIODS),
            cache_saved=sum(priced) if priced else None,
            cache_reads=sum(row.cached_tokens for row in found),
            cache_writes=sum(row.cache_write_tokens for row in found),
            lanes=lanes,
        )

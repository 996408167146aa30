"""The console's pages and its two write actions (replay, retry).

Every page checks the sign-in cookie first and sends a stranger to the login
form. Reads only read; the write actions are POSTs carrying the CSRF token,
each idempotent (a second replay or retry finds nothing to do and says so).
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlencode

import structlog
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, PackageLoader, select_autoescape

from oncely.console.session import COOKIE, COOKIE_MAX_AGE_S, ConsoleKey
from oncely.jobs import dead_letters
from oncely.jobs.inspection import UNREPORTED_NOTE, inspect_job
from oncely.jobs.store import JOB_STATUSES, Jobs
from oncely.outbox.store import OutboxStore

if TYPE_CHECKING:
    from oncely.api.app import OncelyAPI

log = structlog.get_logger("oncely.console")

STATUSES = JOB_STATUSES
# Read pages reload themselves this often while open.
REFRESH_S = 10
_LIST_LIMIT = 100
_HEADERS = {
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": (
        "default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
}


def _templates() -> Environment:
    env = Environment(
        loader=PackageLoader("oncely.console", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
    )
    env.filters["pretty"] = lambda v: json.dumps(v, indent=2, sort_keys=True, ensure_ascii=False)
    env.filters["when"] = _when
    return env


def _when(value: datetime | float | None) -> str:
    if value is None:
        return "—"
    if isinstance(value, float | int):
        value = datetime.fromtimestamp(value, UTC)
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


class Console:
    """What every page needs: the API's clients, the key and the templates."""

    def __init__(self, api: OncelyAPI, key: str) -> None:
        self.api = api
        self.key = ConsoleKey(key)
        self.templates = _templates()
        self.workflows = [w.name for w in api.app]

    @property
    def jobs(self) -> Jobs:
        return self.api.jobs

    @property
    def outbox(self) -> OutboxStore:
        return OutboxStore(self.api.clients.pool)

    def signed_in(self, request: Request) -> bool:
        return self.key.signed_in(request.cookies.get(COOKIE))

    def page(self, name: str, http_status: int = 200, **context: Any) -> HTMLResponse:
        body = self.templates.get_template(name).render(
            workflows=self.workflows, csrf=self.key.csrf_token(), **context
        )
        return HTMLResponse(body, status_code=http_status, headers=_HEADERS)

    def not_found(self, what: str) -> HTMLResponse:
        return self.page("missing.html", http_status=404, what=what)


def _to_login() -> RedirectResponse:
    return RedirectResponse("/console/login", status_code=303)


def _redirect(path: str, **query: str) -> RedirectResponse:
    return RedirectResponse(f"{path}?{urlencode(query)}" if query else path, status_code=303)


async def _form(request: Request) -> dict[str, str]:
    fields = parse_qs((await request.body()).decode("utf-8", "replace"))
    return {name: values[0] for name, values in fields.items()}


def console_router(api: OncelyAPI, key: str) -> APIRouter:
    """The console's routes under /console for ``api``'s app, behind ``key``."""
    console = Console(api, key)
    router = APIRouter(prefix="/console", include_in_schema=False)
    _add_login(router, console)
    _add_overview(router, console)
    _add_jobs(router, console)
    _add_dead_letters(router, console)
    _add_outbox(router, console)
    return router


def _add_login(router: APIRouter, console: Console) -> None:
    def signed_in_response(request: Request) -> Response:
        response = RedirectResponse("/console", status_code=303)
        response.set_cookie(
            COOKIE,
            console.key.cookie_value,
            max_age=COOKIE_MAX_AGE_S,
            path="/console",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return response

    def check(request: Request, candidate: str | None) -> Response:
        if candidate is None:
            return console.page("login.html", refused=False)
        if not console.key.matches(candidate):
            log.warning("console.login_refused")
            return console.page("login.html", http_status=401, refused=True)
        log.info("console.signed_in")
        return signed_in_response(request)

    @router.get("/login")
    async def login_page(request: Request) -> Response:
        return check(request, request.query_params.get("key"))

    @router.post("/login")
    async def login(request: Request) -> Response:
        return check(request, (await _form(request)).get("key", ""))


def _add_overview(router: APIRouter, console: Console) -> None:
    @router.get("")
    async def overview(request: Request) -> Response:
        if not console.signed_in(request):
            return _to_login()
        counts = await console.jobs.counts()
        streams = console.jobs.streams
        rows = [
            (name, counts.get(name, dict.fromkeys(STATUSES, 0)), await streams[name].stats())
            for name in console.workflows
        ]
        outbox = await console.outbox.counts()
        return console.page(
            "overview.html", refresh=REFRESH_S, rows=rows, outbox=outbox, statuses=STATUSES
        )


def _add_jobs(router: APIRouter, console: Console) -> None:
    @router.get("/workflows/{workflow}/jobs")
    async def job_list(request: Request, workflow: str, status: str = "") -> Response:
        if not console.signed_in(request):
            return _to_login()
        if workflow not in console.workflows:
            return console.not_found("workflow")
        chosen = status if status in STATUSES else None
        jobs = await console.jobs.recent(workflow, chosen, _LIST_LIMIT)
        return console.page(
            "jobs.html",
            refresh=REFRESH_S,
            workflow=workflow,
            jobs=jobs,
            status=chosen,
            statuses=STATUSES,
        )

    @router.get("/workflows/{workflow}/jobs/{job_id}")
    async def job_page(request: Request, workflow: str, job_id: str) -> Response:
        if not console.signed_in(request):
            return _to_login()
        try:
            parsed = uuid.UUID(job_id)
        except ValueError:
            return console.not_found("job")
        if workflow not in console.workflows:
            return console.not_found("job")
        view = await inspect_job(console.jobs, console.outbox, workflow, parsed)
        if view is None:
            return console.not_found("job")
        return console.page(
            "job.html",
            refresh=REFRESH_S,
            workflow=workflow,
            job=view.job,
            deliveries=view.deliveries,
            whereabouts=view.whereabouts,
            unreported_note=UNREPORTED_NOTE,
            outbox=view.outbox,
            checkpoints=view.checkpoints,
        )


def _add_dead_letters(router: APIRouter, console: Console) -> None:
    @router.get("/workflows/{workflow}/dead-letters")
    async def dead_letter_list(
        request: Request, workflow: str, replayed: str = "", missing: str = ""
    ) -> Response:
        if not console.signed_in(request):
            return _to_login()
        if workflow not in console.workflows:
            return console.not_found("workflow")
        letters = await dead_letters.list_dead(console.jobs, workflow, _LIST_LIMIT)
        return console.page(
            "dead_letters.html",
            refresh=REFRESH_S,
            workflow=workflow,
            letters=letters,
            replayed=replayed,
            missing=missing,
        )

    @router.post("/workflows/{workflow}/dead-letters/{dead_id}/replay")
    async def replay(request: Request, workflow: str, dead_id: str) -> Response:
        if not console.signed_in(request):
            return _to_login()
        if not console.key.csrf_ok((await _form(request)).get("csrf")):
            return console.page("forbidden.html", http_status=403)
        if workflow not in console.workflows:
            return console.not_found("workflow")
        job_id = await dead_letters.replay(console.jobs, workflow, dead_id)
        path = f"/console/workflows/{workflow}/dead-letters"
        if job_id is None:
            return _redirect(path, missing=dead_id)
        return _redirect(path, replayed=job_id)


def _add_outbox(router: APIRouter, console: Console) -> None:
    @router.get("/outbox")
    async def failed_outbox(request: Request, retried: str = "", missing: str = "") -> Response:
        if not console.signed_in(request):
            return _to_login()
        rows = await console.outbox.list(failed_only=True, limit=_LIST_LIMIT)
        return console.page(
            "outbox.html", refresh=REFRESH_S, rows=rows, retried=retried, missing=missing
        )

    @router.post("/outbox/{row_id}/retry")
    async def retry(request: Request, row_id: int) -> Response:
        if not console.signed_in(request):
            return _to_login()
        if not console.key.csrf_ok((await _form(request)).get("csrf")):
            return console.page("forbidden.html", http_status=403)
        if not await console.outbox.retry(row_id):
            return _redirect("/console/outbox", missing=str(row_id))
        log.info("console.outbox_retried", outbox_id=row_id)
        return _redirect("/console/outbox", retried=str(row_id))

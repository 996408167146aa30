"""Idempotent POST routes as a FastAPI dependency.

A route takes ``idem: IdempotentRequest = Depends(api.idempotent)`` (see
``oncely.api.app.OncelyAPI``) and wraps its work in ``await idem.run(body,
handler)``. FastAPI has validated the body before the endpoint runs, so a
schema violation is answered 422 without any key being claimed. ``run``
then claims the key, runs the handler once, stores its response for replay,
and releases the key when the handler fails (5xx, exception, cancellation)
so the client's retry runs again.

The handler holds the key for at most ``max_hold_s``: then it is cancelled,
the key released and the request answered 503 (``HoldExpired``). A handler
whose outcome is durable before it returns says so with ``settle``: from
then on that response is the answer, even if the handler is stopped later.
``settle`` may bring Redis writes that follow from the outcome (the intake's
enqueue): they go out in the same round trip as the stored response.
A claim, finalise or release that Redis did not answer is released again in
the background (``IdempotencyStore.release_eventually``), so no key stays
"in progress" for the lock TTL with nothing running.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Annotated, Any

import redis.exceptions
import structlog
from fastapi import Depends, Header, Request
from fastapi.encoders import jsonable_encoder
from pydantic import BaseModel
from starlette.responses import Response

from oncely import metrics
from oncely.api.keys import parse_key
from oncely.api.problems import HoldExpired
from oncely.api.store import Claimed, Finished, IdempotencyStore, StoredResponse, new_token
from oncely.errors import KeyReused, RequestInProgress
from oncely.identity import Scope, fingerprint
from oncely.redis_client import ScriptCall, call_together

log = structlog.get_logger("oncely.idempotency")

REPLAY_HEADER = "Idempotent-Replayed"
MAX_WAIT_S = 10.0
_POLL_S = 0.05
_PREFER_WAIT = re.compile(r"(?:^|[\s,;])wait\s*=\s*(\d+)", re.IGNORECASE)
# Not replayed: recomputed for the replay, or meaningless on it.
_UNSTORED_HEADERS = {"content-length", "date", "server", "transfer-encoding", "idempotent-replayed"}

Handler = Callable[[], Awaitable[Response]]

RETENTION_POLICY = (
    "Idempotency keys are scoped to the tenant, method and route. A finished "
    "request's response is kept for `ONCELY_IDEMPOTENCY_RESULT_TTL_S` (default 24 h) "
    "and replayed byte for byte with `Idempotent-Replayed: true`; a request that is "
    "still running holds its key for `ONCELY_IDEMPOTENCY_LOCK_TTL_S` (default 30 s, "
    "renewed while it runs, for at most `ONCELY_IDEMPOTENCY_MAX_HOLD_S`, default "
    "120 s, then it ends 503). Responses with status 5xx and failed requests are not "
    "kept: retrying with the same key runs the request again."
)


def parse_prefer_wait(values: list[str]) -> float:
    """Seconds from ``Prefer: wait=N`` (RFC 7240), capped at MAX_WAIT_S."""
    for value in values:
        match = _PREFER_WAIT.search(value)
        if match:
            return min(float(match.group(1)), MAX_WAIT_S)
    return 0.0


class IdempotentRequest:
    """One request's claim on its idempotency key."""

    def __init__(
        self, store: IdempotencyStore, scope: Scope, wait_s: float, max_hold_s: float = 120.0
    ) -> None:
        self._store = store
        self.scope = scope
        self._digest = scope.digest
        self._wait_s = wait_s
        self._max_hold_s = max_hold_s
        self._fingerprint: str | None = None
        self._settled: Response | None = None
        self._along: Sequence[ScriptCall] = ()

    @property
    def job_id(self) -> str:
        """Deterministic: every retry of this request names the same job."""
        return str(self.scope.job_id)

    @property
    def fingerprint(self) -> str:
        """The body's fingerprint (canonical JSON, sha256), once ``run`` began:
        a handler stores it with its own record to tell a reused key later."""
        if self._fingerprint is None:
            raise RuntimeError("the fingerprint is known once run() has begun")
        return self._fingerprint

    def settle(self, response: Response, *, along: Sequence[ScriptCall] = ()) -> None:
        """The handler's outcome is durable: answer (and store) ``response``
        even if the handler is stopped or fails after this. ``along``: Redis
        writes that follow from the outcome, sent with the stored response in
        one round trip once the handler is done (each failure goes to its
        ``on_error``; the response stands)."""
        self._settled = response
        self._along = along

    async def known(self) -> bool:
        """Whether a request with this key ran or runs (a retry, not new work)."""
        return await self._store.peek(self._digest) is not None

    async def run(self, body: Any, handler: Handler) -> Response:
        fp = self._fingerprint = fingerprint(_jsonable(body))
        token = new_token()
        outcome = await self._claim(fp, token)
        if isinstance(outcome, Finished):
            metrics.IDEMPOTENCY_REPLAYS.labels(route=self.scope.route).inc()
            log.info(
                "idempotency.replayed", scope=self._digest[:16], status=outcome.response.status
            )
            return _replay(outcome.response)
        return await self._execute(fp, token, handler)

    async def _claim(self, fp: str, token: str) -> Claimed | Finished:
        deadline = asyncio.get_running_loop().time() + self._wait_s
        while True:
            try:
                outcome = await self._store.claim(self._digest, fp, token, tenant=self.scope.tenant)
            except BaseException:
                # The SET may still be applied when Redis wakes up.
                self._store.release_eventually(self._digest, token)
                raise
            if not isinstance(outcome, Claimed) and outcome.fp != fp:
                raise KeyReused("this Idempotency-Key was used with a different request body")
            if isinstance(outcome, Claimed | Finished):
                return outcome
            if asyncio.get_running_loop().time() >= deadline:
                raise RequestInProgress("a request with this Idempotency-Key is still running")
            await asyncio.sleep(_POLL_S)

    async def _execute(self, fp: str, token: str, handler: Handler) -> Response:
        keeper = _LockKeeper(partial(self._keep_lock, token), self._store.lock_ttl_ms / 3000)
        hold = asyncio.timeout(self._max_hold_s)
        try:
            async with hold:
                response = await handler()
        except BaseException as exc:
            response = await self._after_failure(fp, token, exc, expired=hold.expired())
        finally:
            keeper.stop()
        if response.status_code >= 500:
            await asyncio.shield(self._release(token))
            if self._along:
                await asyncio.shield(call_together(self._store.redis, self._along))
            return response
        await asyncio.shield(self._finalise(fp, token, response))
        return response

    async def _after_failure(
        self, fp: str, token: str, exc: BaseException, *, expired: bool
    ) -> Response:
        """A settled outcome survives the handler's failure; otherwise the
        key is released and the failure raised (503 past the max hold)."""
        if self._settled is None:
            # Also on cancellation (client gone): the retry must be able to run.
            await asyncio.shield(self._release(token))
            if expired:
                log.warning("idempotency.hold_expired", scope=self._digest[:16])
                raise HoldExpired(self._max_hold_s) from exc
            raise exc
        if not expired and not isinstance(exc, Exception):
            # Cancelled from outside (client gone, shutdown): keep the outcome.
            await asyncio.shield(self._finalise(fp, token, self._settled))
            raise exc
        log.warning(
            "idempotency.failed_after_settle", scope=self._digest[:16], error=type(exc).__name__
        )
        return self._settled

    async def _finalise(self, fp: str, token: str, response: Response) -> None:
        along, self._along = self._along, ()
        try:
            stored = await self._store.finalise(
                self._digest, token, fp, _capture(response), tenant=self.scope.tenant, along=along
            )
        except redis.exceptions.RedisError as exc:
            # The response stands (the handler's work is done); the marker
            # must not outlive it. A retry runs the handler again.
            log.warning("idempotency.finalise_failed", scope=self._digest[:16], error=repr(exc))
            self._store.release_eventually(self._digest, token)
            return
        if not stored:
            log.warning("idempotency.lock_lost", scope=self._digest[:16], at="finalise")
            metrics.IDEMPOTENCY_LOCKS_LOST.inc()

    async def _release(self, token: str) -> None:
        try:
            await self._store.release(self._digest, token)
        except Exception as exc:
            log.warning("idempotency.release_failed", scope=self._digest[:16], error=repr(exc))
            self._store.release_eventually(self._digest, token)

    async def _keep_lock(self, token: str) -> None:
        """Renew the key now and every third of its TTL until stopped."""
        interval = self._store.lock_ttl_ms / 3000
        while True:
            try:
                renewed = await self._store.renew(self._digest, token)
            except redis.exceptions.RedisError as exc:
                log.warning("idempotency.renew_failed", scope=self._digest[:16], error=repr(exc))
                continue
            if not renewed:
                log.warning("idempotency.lock_lost", scope=self._digest[:16], at="renew")
                metrics.IDEMPOTENCY_LOCKS_LOST.inc()
                return
            await asyncio.sleep(interval)


class _LockKeeper:
    """Starts ``renewals`` only if the request is still going after
    ``after_s`` (a third of the lock TTL). Almost every request finishes in
    milliseconds, so it costs a timer, not a task (bench/README.md, Intake)."""

    def __init__(self, renewals: Callable[[], Awaitable[None]], after_s: float) -> None:
        self._renewals = renewals
        self._task: asyncio.Future[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(after_s, self._start)

    def _start(self) -> None:
        self._task = asyncio.ensure_future(self._renewals())

    def stop(self) -> None:
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()


def _jsonable(body: Any) -> Any:
    """What FastAPI's ``jsonable_encoder`` makes of ``body``, which fingerprints
    have always hashed; for a model, its JSON dump by alias is that already,
    without the encoder's walk over every value (tests/test_idempotency.py)."""
    if isinstance(body, BaseModel):
        return body.model_dump(mode="json", by_alias=True)
    return jsonable_encoder(body)


def mark_replayed(response: Response) -> Response:
    """Mark a handler's response as the replay of an earlier outcome (e.g.
    one recovered from its own store after Redis forgot the key)."""
    response.headers[REPLAY_HEADER] = "true"
    return response


def _capture(response: Response) -> StoredResponse:
    headers = [
        (k.decode("latin-1"), v.decode("latin-1"))
        for k, v in response.raw_headers
        if k.decode("latin-1").lower() not in _UNSTORED_HEADERS
    ]
    return StoredResponse(status=response.status_code, headers=headers, body=bytes(response.body))


def _replay(stored: StoredResponse) -> Response:
    response = Response(content=stored.body, status_code=stored.status)
    response.raw_headers.extend(
        (k.encode("latin-1"), v.encode("latin-1")) for k, v in stored.headers
    )
    response.raw_headers.append((REPLAY_HEADER.lower().encode(), b"true"))
    return response


KEY_HEADER_DOC = (
    "16–255 printable ASCII characters, bare or as a quoted structured-field string. "
    "Required. " + RETENTION_POLICY
)
PREFER_HEADER_DOC = "`wait=N` (N ≤ 10): wait for an in-flight duplicate and replay it."


def idempotent_request_for(
    store: Callable[[], IdempotencyStore], max_hold_s: float = 120.0
) -> Callable[[Request, str], IdempotentRequest]:
    """``(request, tenant) → IdempotentRequest`` for ``store()``'s keys: the
    dependency's work, for a route that resolves the tenant itself (the
    workflows' intake, ``oncely.api.workflows``). Raises for a missing,
    malformed or repeated ``Idempotency-Key``."""

    def request_for(request: Request, tenant_name: str) -> IdempotentRequest:
        key = parse_key(request.headers.getlist("idempotency-key"))
        route = request.scope["route"].path
        scope = Scope(tenant=tenant_name, method=request.method, route=route, key=key)
        wait_s = parse_prefer_wait(request.headers.getlist("prefer"))
        return IdempotentRequest(store(), scope, wait_s, max_hold_s)

    return request_for


def idempotency_dependency(
    store: Callable[[], IdempotencyStore],
    tenant: Callable[..., Awaitable[str]],
    max_hold_s: float = 120.0,
    *,
    document_headers: bool = True,
) -> Callable[..., Awaitable[IdempotentRequest]]:
    """A FastAPI dependency giving an ``IdempotentRequest`` for ``store()``'s
    keys and the tenant that ``tenant`` (itself a dependency) resolves; a
    handler holds its key at most ``max_hold_s``.

    The headers are read from the request either way. With
    ``document_headers`` they are also declared as header parameters, so
    that FastAPI documents them; it then validates each on every request
    too, which the workflows' own routes skip (they document the headers
    with ``oncely.api.route_docs.HEADER_PARAMETERS``: bench/README.md, Intake)."""

    # ``tenant`` is a local: a string annotation could not name it, a default can.
    tenant_dependency = Depends(tenant)
    request_for = idempotent_request_for(store, max_hold_s)

    if not document_headers:

        async def idempotent(request: Request, tenant_name: str = tenant_dependency) -> Any:
            return request_for(request, tenant_name)

        return idempotent

    async def idempotent_request(
        request: Request,
        tenant_name: str = tenant_dependency,
        idempotency_key: Annotated[
            str | None, Header(alias="Idempotency-Key", description=KEY_HEADER_DOC)
        ] = None,
        prefer: Annotated[str | None, Header(description=PREFER_HEADER_DOC)] = None,
    ) -> IdempotentRequest:
        return request_for(request, tenant_name)

    return idempotent_request

"""Idempotent POST routes as a FastAPI dependency.

A route takes ``idem: IdempotentRequest = Depends(api.idempotent)`` (see
``oncely.api.app.OncelyAPI``) and wraps its work in ``await idem.run(body,
handler)``. FastAPI has validated the body before the endpoint runs, so a
schema violation is answered 422 without any key being claimed. ``run``
then claims the key, runs the handler once, stores its response for replay,
and releases the key when the handler fails (5xx, exception, cancellation)
so the client's retry runs again.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import structlog
from fastapi import Depends, Header, Request
from fastapi.encoders import jsonable_encoder
from starlette.responses import Response

from oncely import metrics
from oncely.api.keys import Scope, fingerprint, parse_key
from oncely.api.problems import problem_schema
from oncely.api.store import Claimed, Finished, IdempotencyStore, StoredResponse
from oncely.errors import KeyReused, RequestInProgress

log = structlog.get_logger("oncely.idempotency")

REPLAY_HEADER = "Idempotent-Replayed"
MAX_WAIT_S = 10.0
_POLL_S = 0.05
_PREFER_WAIT = re.compile(r"(?:^|[\s,;])wait\s*=\s*(\d+)", re.IGNORECASE)
# Not replayed: recomputed for the replay, or meaningless on it.
_UNSTORED_HEADERS = {"content-length", "date", "server", "transfer-encoding"}

Handler = Callable[[], Awaitable[Response]]

RETENTION_POLICY = (
    "Idempotency keys are scoped to the tenant, method and route. A finished "
    "request's response is kept for `ONCELY_IDEMPOTENCY_RESULT_TTL_S` (default 24 h) "
    "and replayed byte for byte with `Idempotent-Replayed: true`; a request that is "
    "still running holds its key for `ONCELY_IDEMPOTENCY_LOCK_TTL_S` (default 30 s, "
    "renewed while it runs). Responses with status 5xx and failed requests are not "
    "kept: retrying with the same key runs the request again."
)

IDEMPOTENCY_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: problem_schema("Idempotency-Key missing, malformed or sent twice."),
    401: problem_schema("Missing, unknown or revoked API key."),
    409: {
        **problem_schema("A request with this key and body is still running; retry later."),
        "headers": {"Retry-After": {"schema": {"type": "integer"}, "description": "Seconds."}},
    },
    413: problem_schema("Request body over `ONCELY_MAX_BODY_BYTES`."),
    422: problem_schema(
        "The body failed validation (no key was claimed), or the key was used "
        "before with a different body."
    ),
    503: problem_schema("Redis or PostgreSQL did not answer; nothing was stored."),
}


def replay_header_doc() -> dict[str, Any]:
    return {
        REPLAY_HEADER: {
            "schema": {"type": "string", "enum": ["true"]},
            "description": "Present on a replayed response: the stored original, byte for byte.",
        }
    }


def parse_prefer_wait(values: list[str]) -> float:
    """Seconds from ``Prefer: wait=N`` (RFC 7240), capped at MAX_WAIT_S."""
    for value in values:
        match = _PREFER_WAIT.search(value)
        if match:
            return min(float(match.group(1)), MAX_WAIT_S)
    return 0.0


class IdempotentRequest:
    """One request's claim on its idempotency key."""

    def __init__(self, store: IdempotencyStore, scope: Scope, wait_s: float) -> None:
        self._store = store
        self.scope = scope
        self._digest = scope.digest
        self._wait_s = wait_s

    @property
    def job_id(self) -> str:
        """Deterministic: every retry of this request names the same job."""
        return str(self.scope.job_id)

    async def run(self, body: Any, handler: Handler) -> Response:
        fp = fingerprint(jsonable_encoder(body))
        outcome = await self._claim(fp)
        if isinstance(outcome, Finished):
            metrics.IDEMPOTENCY_REPLAYS.labels(route=self.scope.route).inc()
            log.info(
                "idempotency.replayed", scope=self._digest[:16], status=outcome.response.status
            )
            return _replay(outcome.response)
        return await self._execute(fp, outcome.token, handler)

    async def _claim(self, fp: str) -> Claimed | Finished:
        deadline = asyncio.get_running_loop().time() + self._wait_s
        while True:
            outcome = await self._store.claim(self._digest, fp)
            if not isinstance(outcome, Claimed) and outcome.fp != fp:
                raise KeyReused("this Idempotency-Key was used with a different request body")
            if isinstance(outcome, Claimed | Finished):
                return outcome
            if asyncio.get_running_loop().time() >= deadline:
                raise RequestInProgress("a request with this Idempotency-Key is still running")
            await asyncio.sleep(_POLL_S)

    async def _execute(self, fp: str, token: str, handler: Handler) -> Response:
        keeper = asyncio.create_task(self._keep_lock(token))
        try:
            response = await handler()
        except BaseException:
            # Also on cancellation (client gone): the retry must be able to run.
            await asyncio.shield(self._release(token))
            raise
        finally:
            keeper.cancel()
        if response.status_code >= 500:
            await asyncio.shield(self._release(token))
            return response
        stored = _capture(response)
        if not await asyncio.shield(self._store.finalise(self._digest, token, fp, stored)):
            log.warning("idempotency.lock_lost", scope=self._digest[:16], at="finalise")
            metrics.IDEMPOTENCY_LOCKS_LOST.inc()
        return response

    async def _release(self, token: str) -> None:
        try:
            await self._store.release(self._digest, token)
        except Exception as exc:  # the lock TTL frees the key anyway
            log.warning("idempotency.release_failed", scope=self._digest[:16], error=repr(exc))

    async def _keep_lock(self, token: str) -> None:
        interval = self._store.lock_ttl_ms / 3000
        while True:
            await asyncio.sleep(interval)
            if not await self._store.renew(self._digest, token):
                log.warning("idempotency.lock_lost", scope=self._digest[:16], at="renew")
                metrics.IDEMPOTENCY_LOCKS_LOST.inc()
                return


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


def idempotency_dependency(
    store: Callable[[], IdempotencyStore], tenant: Callable[..., Awaitable[str]]
) -> Callable[..., Awaitable[IdempotentRequest]]:
    """A FastAPI dependency giving an ``IdempotentRequest`` for ``store()``'s
    keys and the tenant that ``tenant`` (itself a dependency) resolves."""

    # ``tenant`` is a local: a string annotation could not name it, a default can.
    tenant_dependency = Depends(tenant)

    async def idempotent_request(
        request: Request,
        tenant_name: str = tenant_dependency,
        idempotency_key: Annotated[
            str | None,
            Header(
                alias="Idempotency-Key",
                description="16–255 printable ASCII characters, bare or as a quoted "
                "structured-field string. Required. " + RETENTION_POLICY,
            ),
        ] = None,
        prefer: Annotated[
            str | None,
            Header(description="`wait=N` (N ≤ 10): wait for an in-flight duplicate and replay it."),
        ] = None,
    ) -> IdempotentRequest:
        key = parse_key(request.headers.getlist("idempotency-key"))
        route = request.scope["route"].path
        scope = Scope(tenant=tenant_name, method=request.method, route=route, key=key)
        wait_s = parse_prefer_wait(request.headers.getlist("prefer"))
        return IdempotentRequest(store(), scope, wait_s)

    return idempotent_request

"""The clients: each planned request sent as a well-behaved client would, with its answers."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.chaos.common import POLL_S, say
from bench.chaos.plan import Clock, Planned, approval_of, conflicting_approval_of


@dataclass
class Answer:
    """The final answer to one send (after retries), and what it took."""

    status: int | None  # None: nothing final within the accept timeout
    body: bytes = b""
    replayed: bool = False
    attempts: int = 0
    retried: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass(frozen=True)
class EventSend:
    """One send of a review's approval event, and its final answer."""

    # first (and again: the same key at once), conflict (another payload and
    # key, after the first), after (once the job finished).
    label: str
    key: str
    payload: dict[str, Any]
    answer: Answer
    # The job's status the client waited for before sending ("": it did not look).
    seen: str


@dataclass
class Outcome:
    planned: Planned
    answers: list[Answer] = field(default_factory=list)
    reuse: Answer | None = None
    events: list[EventSend] = field(default_factory=list)

    @property
    def accepted(self) -> list[Answer]:
        return [a for a in self.answers if a.status == 202]

    @property
    def job_id(self) -> str | None:
        accepted = self.accepted
        return str(json.loads(accepted[0].body)["job_id"]) if accepted else None


# 409s that are answers, not "try again": the event routes' own.
FINAL_CONFLICTS = ("/event-already-received", "/job-finished")
FINISHED = ("done", "dead", "cancelled")


class Client:
    """A well-behaved client: the same key until a final answer (202, 4xx but
    409/429), retrying 409 (a key in progress), 429, 5xx, timeouts and
    connection errors. For a review it also sends the approval event as the
    request's plan says."""

    def __init__(
        self, session: aiohttp.ClientSession, api_keys: dict[str, str], accept_timeout: float
    ) -> None:
        self.session = session
        self.api_keys = api_keys
        self.accept_timeout = accept_timeout
        self.jitter = random.Random()

    async def run(self, p: Planned) -> Outcome:
        outcome = Outcome(p)
        accepted: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        events = asyncio.create_task(self.send_events(p, accepted)) if p.event else None
        try:
            outcome.answers = await self._intake(p, accepted)
            if not accepted.done():
                accepted.set_result(None)
            if events is not None:
                outcome.events = await events
        finally:
            if events is not None and not events.done():
                events.cancel()
        if p.reused_body is not None and outcome.accepted:
            outcome.reuse = await self.send(p, p.reused_body)
        return outcome

    async def _intake(self, p: Planned, accepted: asyncio.Future[str | None]) -> list[Answer]:
        """The request's sends, as its pattern says; ``accepted`` gets the
        job id at the first 202."""

        async def one() -> Answer:
            answer = await self.send(p, p.body)
            if answer.status == 202 and not accepted.done():
                accepted.set_result(str(json.loads(answer.body)["job_id"]))
            return answer

        if p.pattern == "concurrent":
            return list(await asyncio.gather(*(one() for _ in range(max(2, p.sends)))))
        answers = []
        for n in range(p.sends):
            if n == 1 and p.pattern == "delayed":
                await asyncio.sleep(p.delay_s)
            answers.append(await one())
        return answers

    async def send(self, p: Planned, body: dict[str, Any]) -> Answer:
        return await self.post(p.route, p.key, p.tenant, body)

    async def send_events(
        self, p: Planned, accepted: asyncio.Future[str | None]
    ) -> list[EventSend]:
        """The approval event, as the review's plan says, once it is accepted."""
        job_id = await accepted
        if job_id is None or p.event == "never":
            return []
        route = f"{p.route}/{job_id}/events/approval"
        key, approval = f"{p.key}-approval", approval_of(p)
        if p.event == "early":
            return [await self._event(p, route, key, approval, "first", "")]
        seen = await self.status_until(p, job_id, finished=p.event == "after")
        if p.event == "after":
            return [await self._event(p, route, key, approval, "after", seen)]
        if p.event == "twice":
            both = (
                self._event(p, route, key, approval, label, seen) for label in ("first", "again")
            )
            return list(await asyncio.gather(*both))
        sends = [await self._event(p, route, key, approval, "first", seen)]
        if p.event == "conflict":
            other = conflicting_approval_of(p)
            sends.append(await self._event(p, route, f"{key}-2", other, "conflict", seen))
        return sends

    async def _event(
        self, p: Planned, route: str, key: str, payload: dict[str, Any], label: str, seen: str
    ) -> EventSend:
        answer = await self.post(route, key, p.tenant, payload)
        return EventSend(label, key, payload, answer, seen)

    async def status_until(self, p: Planned, job_id: str, *, finished: bool) -> str:
        """Polls the job until it is neither queued nor running (it waits,
        or it finished), or with ``finished`` until it is done, dead or
        cancelled; the status it had then, "" if never within the accept
        timeout."""
        headers = {"Authorization": f"Bearer {self.api_keys[p.tenant]}"}
        give_up = time.monotonic() + self.accept_timeout
        while time.monotonic() < give_up:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                async with self.session.get(f"{p.route}/{job_id}", headers=headers) as response:
                    status = str((await response.json()).get("status", ""))
                    unfinished = ("", "queued", "running")
                    reached = status in FINISHED if finished else status not in unfinished
                    if response.status == 200 and reached:
                        return status
            await asyncio.sleep(POLL_S * self.jitter.uniform(0.5, 1.5))
        return ""

    async def post(self, route: str, key: str, tenant: str, body: dict[str, Any]) -> Answer:
        answer = Answer(None)
        headers = {
            "Authorization": f"Bearer {self.api_keys[tenant]}",
            "Idempotency-Key": key,
            "Content-Type": "application/json",
        }
        data = json.dumps(body).encode()
        give_up = time.monotonic() + self.accept_timeout
        while time.monotonic() < give_up:
            answer.attempts += 1
            wait_s = await self._attempt(route, data, headers, answer)
            if wait_s is None:
                return answer
            await asyncio.sleep(wait_s)
        answer.status = None
        return answer

    async def _attempt(
        self, route: str, data: bytes, headers: dict[str, str], answer: Answer
    ) -> float | None:
        """One POST: None when its answer is final, else how long to wait."""
        try:
            async with self.session.post(route, data=data, headers=headers) as response:
                body = await response.read()
                status = response.status
                replayed = response.headers.get("Idempotent-Replayed") == "true"
                retry_after = response.headers.get("Retry-After")
        except (aiohttp.ClientError, TimeoutError) as exc:
            answer.retried[type(exc).__name__] += 1
            return self._backoff(answer.attempts)
        retry = status == 429 or status >= 500 or (status == 409 and not _final_conflict(body))
        if retry:
            answer.retried[str(status)] += 1
            hinted = float(retry_after) if retry_after and retry_after.isdigit() else None
            return min(hinted, 2.0) if hinted is not None else self._backoff(answer.attempts)
        answer.status, answer.body, answer.replayed = status, body, replayed
        return None

    def _backoff(self, attempts: int) -> float:
        return min(2.0, 0.1 * 2.0 ** min(attempts, 5)) * self.jitter.uniform(0.5, 1.0)


def problem_type(body: bytes) -> str:
    """A problem answer's ``type`` ("" for anything else)."""
    try:
        problem = json.loads(body)
    except ValueError:
        return ""
    return str(problem.get("type", "")) if isinstance(problem, dict) else ""


def _final_conflict(body: bytes) -> bool:
    return problem_type(body).endswith(FINAL_CONFLICTS)


async def send_all(
    planned: list[Planned], client: Client, rate: float, clock: Clock
) -> list[Outcome]:
    """Start request i at i / rate seconds; wait for every one to finish."""

    async def later(p: Planned) -> Outcome:
        await asyncio.sleep(p.index / rate)
        return await client.run(p)

    tasks = [asyncio.create_task(later(p)) for p in planned]
    every = max(1, len(tasks) // 10)
    try:
        for done, finished in enumerate(asyncio.as_completed(tasks), start=1):
            await finished
            if done % every == 0:
                say(f"{done}/{len(tasks)} requests answered at {clock.offset():.0f} s")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return [t.result() for t in tasks]

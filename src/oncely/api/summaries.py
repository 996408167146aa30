"""The reference workflow's routes: accept a text to summarise, read the result."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel, EmailStr, Field

from oncely import metrics
from oncely.api.auth import Tenant
from oncely.api.idempotency import IDEMPOTENCY_RESPONSES, Idempotent, replay_header_doc
from oncely.api.problems import problem_schema
from oncely.queue.stream import JobMessage, Stream
from oncely.sql import query

router = APIRouter(prefix="/v1/summaries", tags=["summaries"])


class SummaryRequest(BaseModel):
    text: str = Field(min_length=1, max_length=100_000, description="The text to summarise.")
    notify: EmailStr = Field(description="Who gets the summary by email.")


class Accepted(BaseModel):
    job_id: uuid.UUID
    status: Literal["queued"]


class SummaryJob(BaseModel):
    job_id: uuid.UUID
    status: Literal["queued", "done", "dead"]
    summary: str | None = None
    error: str | None = None
    created_at: datetime
    updated_at: datetime


# async: a plain ``def`` dependency would run in the thread pool per request.
async def _pool(request: Request) -> AsyncConnectionPool:
    pool: AsyncConnectionPool = request.app.state.pool
    return pool


async def _stream(request: Request) -> Stream:
    stream: Stream = request.app.state.stream
    return stream


Pool = Annotated[AsyncConnectionPool, Depends(_pool)]
JobStream = Annotated[Stream, Depends(_stream)]


@router.post(
    "",
    status_code=202,
    response_model=Accepted,
    summary="Accept a text to summarise and email",
    responses={
        202: {
            "description": "Accepted (or, with `Idempotent-Replayed`, the stored original).",
            "headers": {
                "Location": {"schema": {"type": "string"}, "description": "The job's URL."},
                **replay_header_doc(),
            },
        },
        **IDEMPOTENCY_RESPONSES,
    },
)
async def create_summary(
    body: SummaryRequest, tenant: Tenant, idem: Idempotent, pool: Pool, stream: JobStream
) -> Response:
    async def accept() -> Response:
        payload = body.model_dump(mode="json")
        # Postgres is the record of acceptance; the stream is only dispatch.
        async with pool.connection() as conn:
            await conn.execute(query("insert_job"), (idem.job_id, tenant, Jsonb(payload)))
        await stream.enqueue(JobMessage.new(idem.job_id, tenant, payload))
        metrics.JOBS_ACCEPTED.inc()
        return JSONResponse(
            {"job_id": idem.job_id, "status": "queued"},
            status_code=202,
            headers={"Location": f"/v1/summaries/{idem.job_id}"},
        )

    return await idem.run(body, accept)


@router.get(
    "/{job_id}",
    response_model=SummaryJob,
    summary="Read a job and, once done, its summary",
    responses={404: problem_schema("No such job for this tenant.")},
)
async def get_summary(job_id: str, tenant: Tenant, pool: Pool) -> SummaryJob:
    try:
        parsed = uuid.UUID(job_id)
    except ValueError:
        raise HTTPException(404, "job not found") from None
    async with pool.connection() as conn:
        cur = await conn.execute(query("get_job"), (parsed, tenant))
        row = await cur.fetchone()
    if row is None:
        raise HTTPException(404, "job not found")
    jid, status, summary, error, created_at, updated_at = row
    return SummaryJob(
        job_id=jid,
        status=status,
        summary=summary,
        error=error,
        created_at=created_at,
        updated_at=updated_at,
    )

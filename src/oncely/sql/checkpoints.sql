-- Statements on the checkpoints and job_events tables, and on the job's
-- waiting state that moves with them (status waiting / cancelled,
-- wait_until, waiting_for, resumed_at, generation), by name. Read with
-- oncely.sql.query("name"). Only oncely.jobs.checkpoints runs them.
--
-- Every write for a running job first locks its row (FOR NO KEY UPDATE) and
-- checks it is still `queued` in the same generation: a cancel, a finish
-- or a rewind that committed meanwhile is seen after the lock, so nothing
-- is written for a job that is done, dead or cancelled, nor by a delivery
-- of an earlier run.

-- name: job_runs
-- What deliveries of these jobs resume from: each job's status and
-- generation, and its checkpoints (one row per checkpoint; a job without
-- any gives one row of NULLs). Batched across the worker's handlers.
SELECT j.job_id, j.status, j.generation, j.parent_id,
       c.key, c.ordinal, c.kind, c.status, c.value, c.usage, c.until, c.finished_at,
       false, c.request
  FROM jobs j LEFT JOIN checkpoints c USING (job_id)
 WHERE j.job_id = ANY(%s::uuid[])

-- name: write_checkpoints
-- Checkpoints runs reached, with the effects emitted before each: one
-- statement for the writes of any number of jobs (`writes`, one element
-- per run, `n` its place in the batch; batched across a worker's handlers
-- the way GroupCommit batches). Each job's row is locked first, in job id
-- order (two batches locking the same jobs never deadlock), and only runs
-- whose job still runs in their generation write anything. A key already
-- stored fails the whole statement (unique violation): the caller writes
-- each run alone to learn which one lost its race and replays. Answers
-- the `n` of the runs written; one not answered is no longer running.
WITH w AS (
    SELECT * FROM jsonb_to_recordset(%(writes)s)
           AS w (n integer, job_id uuid, generation integer, workflow text,
                 trace_context text, checkpoints jsonb, effects jsonb)
), job AS (
    SELECT job_id, generation FROM jobs
     WHERE job_id IN (SELECT job_id FROM w) AND status = 'queued'
     ORDER BY job_id
       FOR NO KEY UPDATE
), running AS (
    SELECT w.* FROM w JOIN job USING (job_id, generation)
), steps AS (
    INSERT INTO checkpoints (job_id, key, ordinal, kind, status, value, usage, finished_at, request)
    SELECT r.job_id, s.key, s.ordinal, s.kind, s.status, s.value, s.usage, now(), s.request
      FROM running r,
           jsonb_to_recordset(r.checkpoints)
           AS s (key text, ordinal integer, kind text, status text, value text, usage jsonb,
                 request text)
), outbox_rows AS (
    INSERT INTO outbox (topic, dedupe_key, payload, workflow, job_id, trace_context)
    SELECT e.topic, e.dedupe_key, e.payload, r.workflow, r.job_id, r.trace_context
      FROM running r,
           jsonb_to_recordset(r.effects) AS e (topic text, dedupe_key text, payload jsonb)
    ON CONFLICT (dedupe_key) DO NOTHING
)
SELECT n FROM running

-- name: lock_running_job
-- The first statement of a map's wait's transaction: the job's row, locked,
-- if it still runs in this generation, and its tenant.
SELECT status, tenant FROM jobs
 WHERE job_id = %(job_id)s AND status = 'queued' AND generation = %(generation)s
   FOR NO KEY UPDATE

-- name: start_wait
-- A wait, in one statement: the job's row locked first, then the run's
-- unwritten checkpoints, the wait itself, its effects, a call's row and the
-- delivery (the function `oncely_start_wait`, migration 0020, says why a
-- function and what it writes). No rows: the job no longer runs in this
-- generation, and nothing was written; else the wait's status and value.
SELECT wait_status, wait_value FROM oncely_start_wait(
    %(job_id)s, %(generation)s, %(workflow)s, %(trace_context)s, %(key)s, %(ordinal)s,
    %(kind)s, %(event)s, %(seconds)s, %(waiting_for)s, %(detail)s, %(call_topic)s,
    %(call_dedupe_key)s, %(call_payload)s, %(request)s, %(checkpoints)s, %(effects)s,
    %(delivery)s, %(consumer)s, %(started_at)s, %(model_calls)s)

-- name: lock_job_for_event
-- The first statement of an event's transaction: the tenant's job of this
-- workflow, locked (none: 404).
SELECT status, waiting_for FROM jobs
 WHERE job_id = %(job_id)s AND tenant = %(tenant)s AND kind = %(kind)s
   AND status <> 'withdrawn'
   FOR NO KEY UPDATE

-- name: event_fingerprint
SELECT fingerprint FROM job_events WHERE job_id = %(job_id)s AND name = %(event)s

-- name: receive_event
-- The event stored; when the job waits for it, the wait ends with it and
-- the job is queued again (returned, to be enqueued).
WITH stored AS (
    INSERT INTO job_events (job_id, name, payload, fingerprint)
    VALUES (%(job_id)s, %(event)s, %(payload)s, %(fingerprint)s)
), wait AS (
    UPDATE checkpoints SET status = 'done', value = (%(payload)s)::text, finished_at = now()
     WHERE job_id = %(job_id)s AND status = 'waiting' AND kind IN ('wait', 'approval', 'uncertain')
       AND %(resume)s
    RETURNING job_id
)
UPDATE jobs
   SET status = 'queued', waiting_for = NULL, waiting_detail = NULL, wait_until = NULL,
       resumed_at = now(), updated_at = now()
 WHERE job_id IN (SELECT job_id FROM wait)
RETURNING job_id, tenant, kind, payload

-- name: resume_due_jobs
-- The timer service, safe in every worker at once (SKIP LOCKED): waiting
-- jobs whose time has come (of `ids` only, when given: the relay resuming
-- a job whose call ended, which set its time to now). The wait ends with no
-- event (JSON null), the sleep ends, a call times out (a failed checkpoint:
-- CallFailed); the jobs are queued again and returned, to be enqueued, with
-- the keys of their calls that timed out.
WITH due AS (
    SELECT job_id FROM jobs
     WHERE status = 'waiting' AND wait_until <= now() AND kind = ANY(%(kinds)s)
       AND (%(ids)s::uuid[] IS NULL OR job_id = ANY(%(ids)s::uuid[]))
     ORDER BY wait_until
     LIMIT %(limit)s
       FOR NO KEY UPDATE SKIP LOCKED
), ended AS (
    UPDATE checkpoints c
       SET status = CASE WHEN c.kind = 'call' THEN 'failed' ELSE 'done' END,
           value = CASE WHEN c.kind = 'call'
                        THEN '{"error": "CallFailed", "message": "no answer within the call''s timeout", "transient": false, "status": null, "reason": "timeout"}'
                        ELSE 'null' END,
           finished_at = now()
      FROM due WHERE c.job_id = due.job_id AND c.status = 'waiting'
    RETURNING c.job_id, c.key, c.kind
), unanswered AS (
    -- A call that timed out is not sent any more (unless a relay holds it now).
    UPDATE outbox o SET failed_at = now(), last_error = 'the call timed out'
      FROM ended e
     WHERE e.kind = 'call' AND o.job_id = e.job_id AND o.call_key = e.key
       AND o.sent_at IS NULL AND o.failed_at IS NULL
       AND (o.locked_until IS NULL OR o.locked_until < now())
)
UPDATE jobs j
   SET status = 'queued', waiting_for = NULL, waiting_detail = NULL, wait_until = NULL,
       resumed_at = now(), updated_at = now()
  FROM due
 WHERE j.job_id = due.job_id
RETURNING j.job_id, j.tenant, j.kind, j.payload,
          ARRAY(SELECT e.key FROM ended e WHERE e.job_id = j.job_id AND e.kind = 'call')

-- name: cancel_job
-- A queued (running) or waiting job becomes `cancelled`; answers the status
-- it had and its parent, if it is a map's child (none: no such job for
-- this tenant and workflow). NULL tenant or kind: any (operators).
WITH target AS (
    SELECT job_id, status FROM jobs
     WHERE job_id = %(job_id)s
       AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s::text)
       AND (%(kind)s::text IS NULL OR kind = %(kind)s::text)
       AND status <> 'withdrawn'
       FOR NO KEY UPDATE
), cancelled AS (
    UPDATE jobs SET status = 'cancelled', waiting_for = NULL, waiting_detail = NULL, wait_until = NULL,
                    error = NULL, updated_at = now()
     WHERE job_id IN (SELECT job_id FROM target WHERE status IN ('queued', 'waiting', 'held'))
)
SELECT t.status, j.kind, j.parent_id FROM target t JOIN jobs j USING (job_id)

-- name: lock_finished_job
-- The first statement of a rewind's transaction: the job, locked.
SELECT status, tenant, kind, payload FROM jobs WHERE job_id = %(job_id)s FOR NO KEY UPDATE

-- name: rewind_job
-- A dead or cancelled job's checkpoints from `key`'s ordinal on deleted,
-- and the job queued again in a new generation. Answers the checkpoints
-- deleted (none when `key` is not among them: nothing changes).
WITH target AS (
    SELECT ordinal FROM checkpoints WHERE job_id = %(job_id)s AND key = %(key)s
), gone AS (
    DELETE FROM checkpoints
     WHERE job_id = %(job_id)s AND ordinal >= (SELECT ordinal FROM target)
    RETURNING key
), job AS (
    UPDATE jobs
       SET status = 'queued', error = NULL, waiting_for = NULL, waiting_detail = NULL, wait_until = NULL,
           generation = generation + 1, resumed_at = now(), updated_at = now()
     WHERE job_id = %(job_id)s AND EXISTS (SELECT 1 FROM target)
)
SELECT key FROM gone

-- name: job_checkpoints
-- A job's checkpoints in the order the run reached them, values included
-- (operators), or left out: the rows, and those kept with the result
-- (whose values are not kept: the result holds what came of them).
SELECT key, ordinal, kind, status, value, usage, until, finished_at, with_result FROM (
    SELECT key, ordinal, kind, status, CASE WHEN %(values)s THEN value END AS value,
           usage, until, finished_at, false AS with_result
      FROM checkpoints WHERE job_id = %(job_id)s
    UNION ALL
    SELECT k.key, k.ordinal, k.kind, k.status, NULL, k.usage, NULL, r.created_at, true
      FROM results r,
           jsonb_to_recordset(r.steps)
           AS k (key text, ordinal integer, kind text, status text, usage jsonb)
     WHERE r.job_id = %(job_id)s
) s ORDER BY ordinal

-- name: job_status
SELECT status FROM jobs WHERE job_id = %(job_id)s

-- name: job_events
-- The events a job received (shadow runs get the primary's).
SELECT name, payload FROM job_events WHERE job_id = %(job_id)s

-- name: waiting_jobs_by_kind
SELECT kind, count(*) FROM jobs WHERE status = 'waiting' GROUP BY kind

-- name: job_waiting_detail
-- What a waiting job of this tenant and workflow waits on (none: no rows).
SELECT waiting_for, waiting_detail FROM jobs
 WHERE job_id = %(job_id)s AND tenant = %(tenant)s AND kind = %(kind)s AND status = 'waiting'

-- name: flag_diverged
-- Model turns a replay asked with another request than the stored one's
-- (it was given the stored answer): shown on the job's steps.
UPDATE checkpoints SET diverged = true WHERE job_id = %(job_id)s AND key = ANY(%(keys)s)

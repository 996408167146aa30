-- Statements on the jobs and results tables, by name. Read with
-- oncely.sql.query("name"). Only oncely.jobs.store runs them.

-- name: insert_job
INSERT INTO jobs (job_id, tenant, kind, payload) VALUES (%s, %s, %s, %s)
ON CONFLICT (job_id) DO NOTHING

-- name: accept_job
-- The intake, one round trip: record the job with the request's fingerprint
-- and this attempt's intake token, or answer the row already there.
-- `fresh` is true when this statement recorded the job: inserted it, or took
-- over a `withdrawn` row left by earlier attempts (intakes answered 503; an
-- attempt already withdrawn, whose insert lands late, takes nothing over).
-- A queued row with the same fingerprint is adopted: this attempt joins
-- `adopters`, so the row is withdrawn only if this attempt is withdrawn too
-- (see withdraw_jobs). Otherwise the existing row is answered as it is
-- (fresh = false). (`created_at = now()` holds only for a row written by
-- this transaction.)
WITH upsert AS (
    INSERT INTO jobs AS j (job_id, tenant, kind, payload, fingerprint, intake_token)
    VALUES (%(job_id)s, %(tenant)s, %(kind)s, %(payload)s, %(fingerprint)s, %(token)s)
    ON CONFLICT (job_id) DO UPDATE
       SET intake_token = CASE WHEN j.status = 'withdrawn' THEN EXCLUDED.intake_token
                               ELSE j.intake_token END,
           adopters = CASE WHEN j.status = 'withdrawn' THEN '{}'
                           ELSE array_append(j.adopters, EXCLUDED.intake_token) END,
           status = 'queued',
           payload = EXCLUDED.payload,
           fingerprint = EXCLUDED.fingerprint,
           error = NULL,
           created_at = CASE WHEN j.status = 'withdrawn' THEN now() ELSE j.created_at END,
           updated_at = CASE WHEN j.status = 'withdrawn' THEN now() ELSE j.updated_at END
     WHERE (j.status = 'withdrawn' AND NOT EXCLUDED.intake_token = ANY(j.unanswered))
        OR (j.status = 'queued' AND j.fingerprint = EXCLUDED.fingerprint)
    RETURNING j.created_at = now() AS fresh, j.fingerprint
)
SELECT fresh, fingerprint FROM upsert
UNION ALL
SELECT false, fingerprint FROM jobs
 WHERE job_id = %(job_id)s AND NOT EXISTS (SELECT 1 FROM upsert)

-- name: withdraw_jobs
-- Intakes answered 503 whose insert may still land. Each attempt joins its
-- row's `unanswered`; a queued row becomes `withdrawn` once every attempt
-- that touched it (its writer and its adopters) is unanswered, so a row
-- another attempt was answered 202 for stays queued. Where no row exists
-- yet, a `withdrawn` one is written first, so the late insert changes
-- nothing. `undone`: this statement withdrew a row that had landed.
INSERT INTO jobs AS j (job_id, tenant, kind, payload, intake_token, unanswered, status)
SELECT w.job_id, w.tenant, w.kind, '{}'::jsonb, w.token, ARRAY[w.token], 'withdrawn'
  FROM unnest(%(job_ids)s::uuid[], %(tenants)s::text[], %(kinds)s::text[],
              %(tokens)s::uuid[]) AS w (job_id, tenant, kind, token)
ON CONFLICT (job_id) DO UPDATE
   SET unanswered = array_append(j.unanswered, EXCLUDED.intake_token),
       status = CASE WHEN j.status = 'queued'
                      AND array_append(j.adopters, j.intake_token)
                          <@ array_append(j.unanswered, EXCLUDED.intake_token)
                     THEN 'withdrawn' ELSE j.status END,
       updated_at = CASE WHEN j.status = 'queued'
                          AND array_append(j.adopters, j.intake_token)
                              <@ array_append(j.unanswered, EXCLUDED.intake_token)
                         THEN now() ELSE j.updated_at END
RETURNING j.job_id,
          j.status = 'withdrawn' AND j.updated_at = now() AND j.created_at <> now() AS undone

-- name: get_job
-- With what it waits for and its checkpoints' summaries (never their values:
-- the `steps` tenants see), in the order its run reached them: the rows,
-- and those kept with the result; its parent (a map's child), and while it
-- waits on a map, what the map's children count.
SELECT j.job_id, j.tenant, j.kind, j.status, r.result, r.usage, j.error,
       j.created_at, j.updated_at, j.waiting_for, j.wait_until, j.waiting_detail,
       (SELECT coalesce(json_agg(json_build_object(
                   'key', s.key, 'kind', s.kind, 'status', s.status,
                   'finished_at', s.finished_at, 'usage', s.usage, 'diverged', s.diverged,
                   'decision', s.decision, 'resolution', s.resolution)
                   ORDER BY s.ordinal), '[]')
          FROM (SELECT c.key, c.ordinal, c.kind, c.status, c.finished_at, c.usage, c.diverged,
                       -- A person's decision: who, and why (never the arguments).
                       CASE WHEN c.kind = 'approval' AND c.status = 'done'
                                 AND jsonb_typeof(c.value::jsonb) = 'object'
                            THEN c.value::jsonb - 'arguments' END AS decision,
                       -- A person's word on an uncertain call: which, who, why
                       -- (never the result given).
                       CASE WHEN c.kind = 'uncertain' AND c.status = 'done'
                                 AND jsonb_typeof(c.value::jsonb) = 'object'
                            THEN jsonb_build_object(
                                'chose', CASE WHEN c.value::jsonb ? 'resend' THEN 'resend'
                                              WHEN c.value::jsonb ? 'failed' THEN 'failed'
                                              ELSE 'result' END,
                                'by', c.value::jsonb ->> 'by',
                                'reason', c.value::jsonb ->> 'failed') END AS resolution
                  FROM checkpoints c WHERE c.job_id = j.job_id
                UNION ALL
                SELECT k.key, k.ordinal, k.kind, k.status, r.created_at, k.usage, false, NULL, NULL
                  FROM jsonb_to_recordset(r.steps)
                       AS k (key text, ordinal integer, kind text, status text, usage jsonb)
               ) s),
       j.parent_id,
       (SELECT json_build_object(
                   'total', m.total, 'done', m.done, 'dead', m.dead, 'cancelled', m.cancelled,
                   'running', GREATEST(m.released - m.done - m.dead - m.cancelled, 0),
                   'queued', m.total - m.released)
          FROM job_maps m
         WHERE m.parent_id = j.job_id AND j.waiting_for = 'map:' || m.key)
  FROM jobs j LEFT JOIN results r USING (job_id)
 WHERE j.job_id = %s AND j.tenant = %s AND j.kind = %s AND j.status <> 'withdrawn'

-- name: finish_job
-- One statement, for the results of any number of jobs (`finished`, one
-- element per delivery, `n` its place; batched across a worker's handlers
-- the way GroupCommit batches, no job twice in one): atomic without
-- BEGIN/COMMIT, one round trip. The jobs' rows are locked in job id order
-- (two batches touching the same jobs never deadlock). Each job's `done`,
-- only while it still runs in its delivery's generation (the row lock
-- orders this after a cancel or another delivery's finish, which then
-- leave nothing to update); the result, with the run's last checkpoints
-- (`steps`: never replayed, a done job does not run again, so they are
-- kept in its row, not as checkpoint rows); and, only for the deliveries
-- that stored their result, the outbox rows their step emitted. A
-- duplicate delivery that lost the race changes nothing, so effects exist
-- if and only if the result does. (Data-modifying CTEs always run, read or
-- not.) Answers the `n` of the deliveries that stored their result. The
-- relay's wake-up is sent after the commit, coalesced per worker: a NOTIFY
-- inside every transaction would serialise commits on the notification
-- queue's lock.
WITH f AS (
    SELECT * FROM jsonb_to_recordset(%(finished)s)
           AS f (n integer, job_id uuid, generation integer, workflow text, result jsonb,
                 usage jsonb, steps jsonb, effects jsonb, trace_context text,
                 delivery integer, consumer text, started_at timestamptz, model_calls integer)
), locked AS (
    SELECT job_id FROM jobs WHERE job_id IN (SELECT job_id FROM f)
     ORDER BY job_id
       FOR NO KEY UPDATE
), job AS (
    UPDATE jobs j SET status = 'done', error = NULL, updated_at = now()
      FROM f
     WHERE j.job_id = f.job_id AND j.job_id IN (SELECT job_id FROM locked)
       AND j.status = 'queued' AND j.generation = f.generation
    RETURNING j.job_id
), result AS (
    INSERT INTO results (job_id, result, usage, steps)
    SELECT f.job_id, f.result, f.usage, f.steps FROM f JOIN job USING (job_id)
    ON CONFLICT (job_id) DO NOTHING
    RETURNING job_id
), outbox_rows AS (
    INSERT INTO outbox (topic, dedupe_key, payload, workflow, job_id, trace_context)
    SELECT e.topic, e.dedupe_key, e.payload, f.workflow, f.job_id, f.trace_context
      FROM f JOIN result USING (job_id),
           jsonb_to_recordset(f.effects) AS e (topic text, dedupe_key text, payload jsonb)
    ON CONFLICT (dedupe_key) DO NOTHING
    RETURNING id
), delivery AS (
    -- Each delivery in its job's history, in the same round trip: `done`,
    -- or `duplicate` when it stored nothing (another delivery finished
    -- first, or the job was cancelled: its model calls were spent all the
    -- same). None when no delivery is named.
    INSERT INTO job_deliveries (job_id, delivery, consumer, started_at, outcome, model_calls)
    SELECT f.job_id, f.delivery, f.consumer, f.started_at,
           CASE WHEN f.job_id IN (SELECT job_id FROM result) THEN 'done' ELSE 'duplicate' END,
           f.model_calls
      FROM f
     WHERE f.delivery IS NOT NULL AND f.job_id IN (SELECT job_id FROM locked)
)
SELECT f.n FROM f JOIN result USING (job_id)

-- name: record_deliveries
-- Failed deliveries in their jobs' histories (retry, dead, cancelled), one
-- statement for any number; a job erased meanwhile gets none.
INSERT INTO job_deliveries (job_id, delivery, consumer, started_at, outcome, error, model_calls)
SELECT d.job_id, d.delivery, d.consumer, d.started_at, d.outcome, d.error, d.model_calls
  FROM unnest(%(job_ids)s::uuid[], %(deliveries)s::integer[], %(consumers)s::text[],
              %(started_at)s::timestamptz[], %(outcomes)s::text[], %(errors)s::text[],
              %(model_calls)s::integer[])
       AS d (job_id, delivery, consumer, started_at, outcome, error, model_calls)
 WHERE EXISTS (SELECT 1 FROM jobs j WHERE j.job_id = d.job_id)

-- name: job_deliveries
-- A job's history, oldest first.
SELECT delivery, consumer, started_at, finished_at, outcome, error, model_calls
  FROM job_deliveries WHERE job_id = %s ORDER BY id

-- name: mark_job_dead
-- Only the run the failed delivery served: a delivery of a run since
-- cancelled and rewound (a new generation) kills nothing. A delivery that
-- never loaded its run (a malformed message, one past its deliveries)
-- names no generation. Answers the job's parent (NULL: it is no map's
-- child), when it died here.
UPDATE jobs SET status = 'dead', error = %(error)s, updated_at = now()
 WHERE job_id = %(job_id)s AND status = 'queued'
   AND (%(generation)s::int IS NULL OR generation = %(generation)s::int)
RETURNING parent_id

-- name: queued_jobs_older_than
-- Queued jobs accepted (and, if they waited, resumed) before the cut-off,
-- after the cursor (created_at, job_id) of the previous page, so that a
-- backlog of jobs still in the stream cannot hide a lost one behind it.
-- The partial index jobs_queued_kind_created_idx walks them in order.
SELECT job_id, tenant, kind, payload, created_at FROM jobs
 WHERE kind = %(kind)s AND status = 'queued'
   AND created_at < now() - make_interval(secs => %(age_s)s)
   AND (resumed_at IS NULL OR resumed_at < now() - make_interval(secs => %(age_s)s))
   AND (%(after_at)s::timestamptz IS NULL
        OR (created_at, job_id) > (%(after_at)s::timestamptz, %(after_id)s::uuid))
 ORDER BY created_at, job_id
 LIMIT %(limit)s

-- name: dead_jobs
-- A workflow's dead jobs, newest first: the dead letters operators list
-- and replay (PostgreSQL is the record; Redis' dead streams only mirror it).
-- `deliveries`: those that reported back.
SELECT j.job_id, j.tenant, j.kind, j.error, j.updated_at,
       (SELECT count(*) FROM job_deliveries d WHERE d.job_id = j.job_id)
  FROM jobs j
 WHERE j.kind = %(kind)s AND j.status = 'dead'
 ORDER BY j.updated_at DESC, j.job_id
 LIMIT %(limit)s

-- name: dead_job
-- One dead job with its request, to replay it; of any workflow when kind is NULL.
SELECT job_id, tenant, kind, payload FROM jobs
 WHERE job_id = %(job_id)s AND status = 'dead'
   AND (%(kind)s::text IS NULL OR kind = %(kind)s::text)

-- name: mark_job_requeued
-- A dead letter replayed by an operator: its job is queued again, in a new
-- generation (a delivery of the dead run can write nothing more), and its
-- checkpoints kept: the new run resumes after them.
UPDATE jobs SET status = 'queued', error = NULL, generation = generation + 1,
                resumed_at = now(), updated_at = now()
 WHERE job_id = %s AND status = 'dead'

-- name: jobs_by_kind_and_status
SELECT kind, status, count(*) FROM jobs WHERE status <> 'withdrawn' GROUP BY kind, status

-- name: purge_finished_jobs
-- Retention, one bounded batch per statement: finished (done, dead or
-- cancelled) jobs last changed before the cut-off whose effects have all
-- left (no unsent outbox row), with their results, outbox rows, deliveries,
-- checkpoints and events. SKIP LOCKED: passes
-- running side by side take different rows. The foreign keys from results
-- and deliveries are checked at the end of the statement, after the deletes.
WITH old AS MATERIALIZED (
    SELECT job_id FROM jobs j
     WHERE status IN ('done', 'dead', 'cancelled')
       AND updated_at < now() - make_interval(secs => %(age_s)s)
       AND NOT EXISTS (
           SELECT 1 FROM outbox o WHERE o.job_id = j.job_id AND o.sent_at IS NULL
       )
     ORDER BY updated_at
     LIMIT %(batch)s
       FOR UPDATE SKIP LOCKED
), outbox_rows AS (
    DELETE FROM outbox o USING old WHERE o.job_id = old.job_id
), result_rows AS (
    DELETE FROM results r USING old WHERE r.job_id = old.job_id
), delivery_rows AS (
    DELETE FROM job_deliveries d USING old WHERE d.job_id = old.job_id
), checkpoint_rows AS (
    DELETE FROM checkpoints c USING old WHERE c.job_id = old.job_id
), event_rows AS (
    DELETE FROM job_events e USING old WHERE e.job_id = old.job_id
)
DELETE FROM jobs j USING old WHERE j.job_id = old.job_id

-- name: purge_withdrawn_jobs
-- Retention for intakes answered 503 and never retried: their withdrawn
-- rows (no result, no outbox rows, no payload) go after the same cut-off.
DELETE FROM jobs WHERE job_id IN (
    SELECT job_id FROM jobs
     WHERE status = 'withdrawn'
       AND updated_at < now() - make_interval(secs => %(age_s)s)
     LIMIT %(batch)s
       FOR UPDATE SKIP LOCKED
)

-- name: erase_tenant_jobs
-- Right to erasure: every job of the tenant, its result, its outbox rows,
-- its deliveries, its checkpoints and its events, whatever their state.
-- Returns the counts.
WITH gone_jobs AS (
    SELECT job_id FROM jobs WHERE tenant = %(tenant)s FOR UPDATE
), outbox_rows AS (
    DELETE FROM outbox o USING gone_jobs g WHERE o.job_id = g.job_id RETURNING o.id
), result_rows AS (
    DELETE FROM results r USING gone_jobs g WHERE r.job_id = g.job_id RETURNING r.job_id
), delivery_rows AS (
    DELETE FROM job_deliveries d USING gone_jobs g WHERE d.job_id = g.job_id RETURNING d.id
), checkpoint_rows AS (
    DELETE FROM checkpoints c USING gone_jobs g WHERE c.job_id = g.job_id RETURNING c.key
), event_rows AS (
    DELETE FROM job_events e USING gone_jobs g WHERE e.job_id = g.job_id RETURNING e.name
), job_rows AS (
    DELETE FROM jobs j USING gone_jobs g WHERE j.job_id = g.job_id RETURNING j.job_id
)
SELECT (SELECT count(*) FROM job_rows) AS jobs,
       (SELECT count(*) FROM result_rows) AS results,
       (SELECT count(*) FROM outbox_rows) AS outbox,
       (SELECT count(*) FROM delivery_rows) AS deliveries,
       (SELECT count(*) FROM checkpoint_rows) AS checkpoints,
       (SELECT count(*) FROM event_rows) AS events

-- name: list_jobs
-- The console's and `oncely jobs list`'s listing: jobs newest first, of one
-- workflow (NULL: any), optionally of one status (NULL: any but withdrawn,
-- which are not jobs), one dead reason (the error's stable prefix) and one
-- parent (a map's children).
SELECT j.job_id, j.tenant, j.kind, j.status, r.result, r.usage, j.error,
       j.created_at, j.updated_at, j.waiting_for, j.wait_until, j.waiting_detail, '[]'::json,
       j.parent_id, NULL::json
  FROM jobs j LEFT JOIN results r USING (job_id)
 WHERE (%(kind)s::text IS NULL OR j.kind = %(kind)s::text) AND j.status <> 'withdrawn'
   AND (%(status)s::text IS NULL OR j.status = %(status)s::text)
   AND (%(reason)s::text IS NULL OR starts_with(j.error, %(reason)s::text || ':'))
   AND (%(parent)s::uuid IS NULL OR j.parent_id = %(parent)s::uuid)
 ORDER BY j.created_at DESC, j.job_id
 LIMIT %(limit)s

-- name: get_job_for_operator
-- A job whatever its tenant, with its request: for operators only. Of one
-- workflow, or (kind NULL) of any.
SELECT j.job_id, j.tenant, j.kind, j.status, r.result, r.usage, j.error,
       j.created_at, j.updated_at, j.waiting_for, j.wait_until, j.waiting_detail, '[]'::json,
       j.parent_id, NULL::json, j.payload
  FROM jobs j LEFT JOIN results r USING (job_id)
 WHERE j.job_id = %(job_id)s AND (%(kind)s::text IS NULL OR j.kind = %(kind)s::text)
   AND j.status <> 'withdrawn'

-- Statements on the schedules table (docs/fanout.md, Schedules), by name.
-- Read with oncely.sql.query("name"). Only oncely.jobs.schedules runs them.
--
-- A schedule's row is its record: the last tick a job was started for.
-- Every worker process looks at it; the update that moves `last_tick`
-- forward is the claim, so one process of the fleet starts each tick's
-- job, in the same transaction.

-- name: known_schedules
-- With PostgreSQL's time, the fleet's one clock (a row of NULLs and the
-- time when no schedule is known yet).
SELECT now(), s.workflow, s.expression, s.last_tick, s.last_job_id
  FROM (SELECT) AS clock
  LEFT JOIN schedules s ON s.workflow = ANY(%(workflows)s::text[])

-- name: start_schedule
-- A schedule seen for the first time starts from `tick` (the last one
-- before now, which does not run: nothing was missed before it existed).
INSERT INTO schedules (workflow, expression, last_tick)
VALUES (%(workflow)s, %(expression)s, %(tick)s)
ON CONFLICT (workflow) DO UPDATE SET expression = EXCLUDED.expression, updated_at = now()
 WHERE schedules.expression <> EXCLUDED.expression

-- name: claim_tick
-- This process starts `tick`'s job, if no process has (the row moves
-- forward once); `job_id` NULL: the tick is skipped (ONCELY_SCHEDULE_CATCH_UP=none).
-- Never a tick PostgreSQL's clock has not reached: a process whose clock
-- runs ahead would start it early and move the row past ticks none ran.
UPDATE schedules SET last_tick = %(tick)s, last_job_id = %(job_id)s, updated_at = now()
 WHERE workflow = %(workflow)s AND (last_tick IS NULL OR last_tick < %(tick)s)
   AND %(tick)s <= now()
RETURNING workflow

-- name: insert_scheduled_job
-- The tick's job, recorded as the intake would record a POST with the
-- idempotency key `schedule:<workflow>:<tick>` (same id, same fingerprint).
INSERT INTO jobs (job_id, tenant, kind, payload, fingerprint)
VALUES (%(job_id)s, %(tenant)s, %(kind)s, %(payload)s, %(fingerprint)s)
ON CONFLICT (job_id) DO NOTHING
RETURNING job_id

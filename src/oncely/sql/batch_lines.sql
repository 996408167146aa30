-- The batch lane's lines (oncely.llm.batches; docs/lanes.md).

-- name: intend_batch_line
-- A call's intent, before any batch exists; a redelivery's is the same row.
INSERT INTO batch_lines (custom_id, job_id, call_key, workflow, tenant, model, dialect, body)
VALUES (%(custom_id)s, %(job_id)s, %(call_key)s, %(workflow)s, %(tenant)s, %(model)s,
        %(dialect)s, %(body)s)
ON CONFLICT (custom_id) DO NOTHING

-- name: batch_line
SELECT status, answer, error, submissions,
       extract(epoch FROM updated_at - created_at)::float8
  FROM batch_lines WHERE custom_id = %s

-- name: retry_batch_line
-- A line that failed transiently, back in line for the next batch.
UPDATE batch_lines
   SET status = 'waiting', batch_id = NULL, provider_id = NULL, lease_until = NULL,
       error = NULL, updated_at = now()
 WHERE custom_id = %s AND status IN ('failed', 'dropped')

-- name: drop_ended_batch_lines
-- Lines of jobs that ended (cancelled, dead, done) before their batch was
-- gathered: never sent.
UPDATE batch_lines l
   SET status = 'dropped', updated_at = now()
  FROM jobs j
 WHERE l.status = 'waiting' AND j.job_id = l.job_id
   AND j.status IN ('cancelled', 'dead', 'done')

-- name: ready_batch_groups
-- The models (and dialects) whose waiting lines make a batch: enough of
-- them, or the oldest waited the gathering time.
SELECT model, dialect
  FROM batch_lines
 WHERE status = 'waiting'
 GROUP BY model, dialect
HAVING count(*) >= %(max_calls)s
    OR min(created_at) <= now() - make_interval(secs => %(gather_s)s)

-- name: gather_batch
-- Up to max_calls waiting lines of one model into the batch `batch_id`,
-- stored before the batch is created, leased to this process while it
-- creates it.
WITH picked AS (
    SELECT custom_id FROM batch_lines
     WHERE status = 'waiting' AND model = %(model)s AND dialect = %(dialect)s
     ORDER BY created_at
     LIMIT %(max_calls)s
       FOR UPDATE SKIP LOCKED
)
UPDATE batch_lines l
   SET status = 'gathered', batch_id = %(batch_id)s, provider_id = NULL, gathered_at = now(),
       lease_until = now() + make_interval(secs => %(lease_s)s),
       submissions = l.submissions + 1, updated_at = now()
  FROM picked
 WHERE l.custom_id = picked.custom_id
RETURNING l.custom_id, l.body

-- name: record_batch
-- The provider's id of the batch, once created: its lines are polled from now.
UPDATE batch_lines
   SET provider_id = %(provider_id)s, lease_until = NULL, updated_at = now()
 WHERE batch_id = %(batch_id)s AND status = 'gathered'

-- name: adopt_batch
-- A batch found at the provider after a crash, recorded as this one's
-- unless another oncely batch recorded it already (then: the next candidate).
UPDATE batch_lines
   SET provider_id = %(provider_id)s, lease_until = NULL, updated_at = now()
 WHERE batch_id = %(batch_id)s AND status = 'gathered'
   AND NOT EXISTS (SELECT 1 FROM batch_lines o
                    WHERE o.provider_id = %(provider_id)s
                      AND o.batch_id IS DISTINCT FROM %(batch_id)s::uuid)

-- name: claim_unrecorded_batches
-- Batches gathered whose creator's lease ran out before it recorded the
-- provider's id (a crash between "gathered" and "recorded"): leased to
-- this process, which looks for them at the provider.
WITH lost AS (
    SELECT DISTINCT batch_id FROM batch_lines
     WHERE status = 'gathered' AND provider_id IS NULL AND lease_until < now()
     LIMIT 20
)
UPDATE batch_lines l
   SET lease_until = now() + make_interval(secs => %(lease_s)s), updated_at = now()
  FROM lost
 WHERE l.batch_id = lost.batch_id AND l.status = 'gathered' AND l.lease_until < now()
RETURNING l.batch_id, l.dialect, l.gathered_at, l.custom_id, l.body

-- name: claim_submitted_batches
-- Recorded batches due a poll, leased to this process until the next one.
WITH due AS (
    SELECT DISTINCT batch_id FROM batch_lines
     WHERE status = 'gathered' AND provider_id IS NOT NULL
       AND (lease_until IS NULL OR lease_until < now())
     LIMIT 50
), claimed AS (
    UPDATE batch_lines l
       SET lease_until = now() + make_interval(secs => %(poll_s)s)
      FROM due
     WHERE l.batch_id = due.batch_id AND l.status = 'gathered'
       AND (l.lease_until IS NULL OR l.lease_until < now())
    RETURNING l.batch_id, l.provider_id, l.dialect
)
SELECT DISTINCT batch_id, provider_id, dialect FROM claimed

-- name: answer_batch_lines
-- A batch's results: each line of that batch answered or failed (a
-- custom_id the batch did not carry changes nothing).
UPDATE batch_lines l
   SET status = r.status, answer = r.answer, error = r.error, lease_until = NULL,
       updated_at = now()
  FROM jsonb_to_recordset(%(rows)s) AS r (custom_id text, status text, answer jsonb, error jsonb)
 WHERE l.custom_id = r.custom_id AND l.batch_id = %(batch_id)s AND l.status = 'gathered'

-- name: end_batch
-- A batch that ended with lines unanswered (expired, cancelled, failed): a
-- line not yet submitted twice goes back in line when the batch expired,
-- any other fails with the batch's status.
UPDATE batch_lines
   SET status = CASE WHEN %(resubmit)s AND submissions < 2 THEN 'waiting' ELSE 'failed' END,
       batch_id = CASE WHEN %(resubmit)s AND submissions < 2 THEN NULL ELSE batch_id END,
       error = CASE WHEN %(resubmit)s AND submissions < 2 THEN NULL ELSE %(error)s END,
       lease_until = NULL, updated_at = now()
 WHERE batch_id = %(batch_id)s AND status = 'gathered'

-- name: list_batches
-- The batches, newest first: where each stands (`gathered`: not created or
-- not recorded yet; `out`: at the provider; `ended`), their lines by status
-- and jobs waiting.
SELECT batch_id,
       CASE WHEN count(*) FILTER (WHERE status = 'gathered' AND provider_id IS NULL) > 0
            THEN 'gathered'
            WHEN count(*) FILTER (WHERE status = 'gathered') > 0 THEN 'out'
            ELSE 'ended' END,
       min(provider_id), min(model), min(dialect),
       count(*) AS lines,
       count(*) FILTER (WHERE status = 'answered') AS answered,
       count(*) FILTER (WHERE status = 'failed') AS failed,
       count(*) FILTER (WHERE status = 'gathered') AS waiting,
       min(created_at), max(updated_at)
  FROM batch_lines
 WHERE batch_id IS NOT NULL AND (%(batch_id)s::uuid IS NULL OR batch_id = %(batch_id)s::uuid)
 GROUP BY batch_id
 ORDER BY min(created_at) DESC
 LIMIT %(limit)s

-- name: lines_of_batch
-- A batch's lines, with the job and the call each stands for (their
-- custom ids are digests: docs/lanes.md).
SELECT custom_id, job_id::text, call_key, status
  FROM batch_lines
 WHERE batch_id = %(batch_id)s::uuid
 ORDER BY created_at, custom_id
 LIMIT %(limit)s

-- name: prune_batch_lines
-- Lines settled (answered, failed, dropped) longer ago than kept whose job
-- ended or is gone, a batch at a time: a job still running keeps its line.
DELETE FROM batch_lines
 WHERE custom_id IN (
    SELECT l.custom_id FROM batch_lines l
     WHERE l.status IN ('answered', 'failed', 'dropped')
       AND l.updated_at < now() - make_interval(secs => %(keep_s)s)
       AND NOT EXISTS (SELECT 1 FROM jobs j
                        WHERE j.job_id = l.job_id AND j.status NOT IN ('done', 'dead', 'cancelled'))
     LIMIT %(limit)s)

-- Statements on the outbox table, by name. Read with oncely.sql.query("name").

-- name: insert_outbox
-- For other workflows: queue a notification in the caller's transaction.
INSERT INTO outbox (topic, dedupe_key, payload) VALUES (%s, %s, %s)
ON CONFLICT (dedupe_key) DO NOTHING

-- name: notify_outbox
SELECT pg_notify('oncely_outbox', '')

-- name: outbox_claim
-- One statement, one short transaction: the CTE locks due rows and skips the
-- ones another relay is claiming this instant; the UPDATE leases them to the
-- owner and counts the attempt now, so a relay killed mid-send has still used
-- one up. The row locks end at commit; the lease, renewed while the relay
-- holds the row (outbox_renew), is what keeps other relays away while the
-- send runs. MATERIALIZED: the locking scan runs exactly once,
-- so a plan that rescans it cannot lease more rows than the limit.
WITH due AS MATERIALIZED (
    SELECT id FROM outbox
     WHERE sent_at IS NULL AND failed_at IS NULL
       AND next_attempt_at <= now()
       AND (locked_until IS NULL OR locked_until < now())
     ORDER BY next_attempt_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
)
UPDATE outbox o
   SET locked_until = now() + make_interval(secs => %(lease_s)s),
       locked_by = %(owner)s,
       attempts = o.attempts + 1
  FROM due
 WHERE o.id = due.id
RETURNING o.id, o.topic, o.dedupe_key, o.payload, o.attempts, o.trace_context, o.call_key,
          extract(epoch FROM now() - o.created_at)::float8 AS age_s

-- name: outbox_renew
-- A live relay's rows leased again from now (docs/architecture.md, Effects):
-- only rows it still holds, unsent, whose lease has not ended. An ended
-- lease is any relay's to claim, so it is never revived. A claim racing
-- this either skips the locked row or, once it committed, leaves no row
-- this owner holds.
UPDATE outbox
   SET locked_until = now() + make_interval(secs => %(lease_s)s)
 WHERE id = ANY(%(ids)s::bigint[]) AND locked_by = %(owner)s
   AND sent_at IS NULL AND failed_at IS NULL AND locked_until >= now()
RETURNING id

-- name: outbox_mark_sent_many
-- Every send that finished while the previous batch was being recorded, in
-- one commit. Claim-checked (the owner and the attempt its claim counted): a
-- relay whose lease expired must not touch a row claimed since, by another
-- relay or by itself again (or already sent).
UPDATE outbox o
   SET sent_at = now(), provider_message_id = v.provider_message_id,
       locked_until = NULL, locked_by = NULL
  FROM unnest(%(ids)s::bigint[], %(attempts)s::int[], %(provider_message_ids)s::text[])
       AS v (id, attempts, provider_message_id)
 WHERE o.id = v.id AND o.locked_by = %(owner)s AND o.attempts = v.attempts
   AND o.sent_at IS NULL
RETURNING o.id, o.attempts

-- name: outbox_mark_answered
-- A call the receiver answered (docs/agents.md): the row marked sent with
-- its answer and, in the same statement, the call's checkpoint given the
-- answer as its value and its job due to resume now (the relay queues it at
-- once; the workers' timers would within a second). Owner-checked as every
-- write after a claim. A call whose wait ended before (its timeout) keeps
-- the answer on its row only. Answers the job woken, if any.
WITH sent AS (
    UPDATE outbox o
       SET sent_at = now(), provider_message_id = %(provider_message_id)s,
           answer = %(answer)s, locked_until = NULL, locked_by = NULL
     WHERE o.id = %(id)s AND o.locked_by = %(owner)s AND o.attempts = %(attempts)s
       AND o.sent_at IS NULL
    RETURNING o.job_id, o.call_key
), answered AS (
    UPDATE checkpoints c
       SET status = 'done', value = (%(answer)s)::text, finished_at = now()
      FROM sent
     WHERE c.job_id = sent.job_id AND c.key = sent.call_key AND c.status = 'waiting'
    RETURNING c.job_id
), woken AS (
    UPDATE jobs j SET wait_until = now()
      FROM answered
     WHERE j.job_id = answered.job_id AND j.status = 'waiting'
    RETURNING j.job_id
)
SELECT EXISTS (SELECT 1 FROM sent) AS held, (SELECT job_id FROM woken) AS woken

-- name: outbox_call_failed
-- A call that will never be answered (refused, an invalid answer, its
-- attempts spent): the row failed and, in the same statement, the call's
-- checkpoint failed with the reason (a CallFailed the step gets) and its
-- job due to resume now. Owner-checked.
WITH failed AS (
    UPDATE outbox
       SET last_error = %(error)s, failed_at = now(), locked_until = NULL, locked_by = NULL
     WHERE id = %(id)s AND locked_by = %(owner)s AND attempts = %(attempts)s
       AND sent_at IS NULL
    RETURNING job_id, call_key
), ended AS (
    UPDATE checkpoints c
       SET status = 'failed', value = %(failure)s, finished_at = now()
      FROM failed
     WHERE c.job_id = failed.job_id AND c.key = failed.call_key AND c.status = 'waiting'
    RETURNING c.job_id
), woken AS (
    UPDATE jobs j SET wait_until = now()
      FROM ended
     WHERE j.job_id = ended.job_id AND j.status = 'waiting'
    RETURNING j.job_id
)
SELECT EXISTS (SELECT 1 FROM failed) AS held, (SELECT job_id FROM woken) AS woken

-- name: outbox_mark_failed_attempt
-- Claim-checked as every write after a claim.
UPDATE outbox
   SET last_error = %(error)s,
       next_attempt_at = now() + make_interval(secs => %(delay_s)s),
       failed_at = CASE WHEN %(give_up)s THEN now() END,
       locked_until = NULL, locked_by = NULL
 WHERE id = %(id)s AND locked_by = %(owner)s AND attempts = %(attempts)s AND sent_at IS NULL
RETURNING id

-- name: outbox_get
SELECT id, topic, dedupe_key, payload, attempts, last_error, next_attempt_at,
       locked_until, locked_by, sent_at, failed_at, provider_message_id, created_at,
       trace_context,
       extract(epoch FROM now() - created_at)::float8 AS age_s
  FROM outbox
 WHERE id = %s

-- name: outbox_list
-- Rows not sent yet (due, leased, backing off or failed), oldest first;
-- with failed_only, just the ones a person has to look at.
SELECT id, topic, dedupe_key, payload, attempts, last_error, next_attempt_at,
       locked_until, locked_by, sent_at, failed_at, provider_message_id, created_at,
       trace_context,
       extract(epoch FROM now() - created_at)::float8 AS age_s
  FROM outbox
 WHERE sent_at IS NULL AND (failed_at IS NOT NULL OR NOT %(failed_only)s)
 ORDER BY id
 LIMIT %(limit)s

-- name: outbox_retry
-- last_error stays for the record; the next failure overwrites it.
UPDATE outbox
   SET failed_at = NULL, attempts = 0, next_attempt_at = now(),
       locked_until = NULL, locked_by = NULL
 WHERE id = %s AND failed_at IS NOT NULL
RETURNING id

-- name: outbox_retry_all_failed
UPDATE outbox
   SET failed_at = NULL, attempts = 0, next_attempt_at = now(),
       locked_until = NULL, locked_by = NULL
 WHERE failed_at IS NOT NULL
RETURNING id

-- name: outbox_delete_sent_before
-- A bounded batch per transaction, so retention never holds many row locks
-- or bloats one transaction while relays are claiming.
WITH old AS MATERIALIZED (
    SELECT id FROM outbox
     WHERE sent_at < now() - make_interval(secs => %(age_s)s)
     ORDER BY sent_at
     LIMIT %(batch)s
       FOR UPDATE SKIP LOCKED
)
DELETE FROM outbox o USING old WHERE o.id = old.id

-- name: outbox_counts
-- Separate subqueries so the unsent ones use the partial due index instead
-- of scanning the sent rows kept for retention.
SELECT (SELECT count(*) FROM outbox
         WHERE sent_at IS NULL AND failed_at IS NULL) AS unsent,
       (SELECT count(*) FROM outbox
         WHERE sent_at IS NULL AND failed_at IS NULL AND locked_until >= now()) AS in_flight,
       (SELECT count(*) FROM outbox WHERE failed_at IS NOT NULL) AS failed,
       (SELECT extract(epoch FROM now() - min(created_at))::float8 FROM outbox
         WHERE sent_at IS NULL AND failed_at IS NULL) AS oldest_unsent_age_s

-- name: outbox_listen
LISTEN oncely_outbox

-- name: outbox_listener_ping
SELECT 1


-- name: list_outbox_for_job
-- Every outbox row a job's step emitted, sent or not, in emission order.
SELECT id, topic, dedupe_key, payload, attempts, last_error, next_attempt_at,
       locked_until, locked_by, sent_at, failed_at, provider_message_id, created_at,
       trace_context,
       extract(epoch FROM now() - created_at)::float8 AS age_s
  FROM outbox
 WHERE job_id = %s
 ORDER BY id

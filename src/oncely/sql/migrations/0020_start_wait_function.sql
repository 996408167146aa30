-- A wait in one statement (docs/architecture.md, "an event and a wait never
-- miss each other"). A wait must lock the job's row before it reads the
-- job's events: a statement's snapshot is taken when it starts, so a lone
-- statement that locked the row in a CTE would not see an event whose
-- transaction held the lock and committed meanwhile. Each statement of a
-- VOLATILE PL/pgSQL function takes a fresh snapshot (READ COMMITTED), so
-- this function locks first and then reads, in one round trip and one
-- statement for the client: the transaction BEGIN, lock_running_job,
-- start_wait, COMMIT was four. A map's wait, which starts its children
-- between the lock and the wait (Python), calls it inside its transaction.
--
-- The row, locked, if the job still runs in this generation (none: no
-- rows, nothing written); then the run's unwritten checkpoints, the wait
-- (or sleep, or call) itself, the effects emitted before it, a call's own
-- outbox row, and the delivery in the job's history. An event already
-- received, or a call already answered (a rewound job reaching it again),
-- ends the wait at once (`done`, its payload the value) and the job keeps
-- running; otherwise the job is `waiting` until the event, the answer or
-- `until`. A call whose row failed before (a rewind) is tried again with
-- fresh attempts.
CREATE OR REPLACE FUNCTION oncely_start_wait(
    p_job_id uuid, p_generation integer, p_workflow text, p_trace_context text,
    p_key text, p_ordinal integer, p_kind text, p_event text, p_seconds double precision,
    p_waiting_for text, p_detail jsonb, p_call_topic text, p_call_dedupe_key text,
    p_call_payload jsonb, p_request text, p_checkpoints jsonb, p_effects jsonb,
    p_delivery integer, p_consumer text, p_started_at timestamptz, p_model_calls integer
) RETURNS TABLE (wait_status text, wait_value text)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM 1 FROM jobs
      WHERE job_id = p_job_id AND status = 'queued' AND generation = p_generation
        FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY
    WITH event AS (
        (SELECT e.payload FROM job_events e WHERE e.job_id = p_job_id AND e.name = p_event)
        UNION ALL
        (SELECT o.answer FROM outbox o
          WHERE o.dedupe_key = p_call_dedupe_key AND o.answer IS NOT NULL)
        LIMIT 1
    ), steps AS (
        INSERT INTO checkpoints (job_id, key, ordinal, kind, status, value, usage, finished_at,
                                 request)
        SELECT p_job_id, s.key, s.ordinal, s.kind, s.status, s.value, s.usage, now(), s.request
          FROM jsonb_to_recordset(p_checkpoints)
               AS s (key text, ordinal integer, kind text, status text, value text, usage jsonb,
                     request text)
    ), wait AS (
        INSERT INTO checkpoints (job_id, key, ordinal, kind, status, value, until, finished_at,
                                 request)
        SELECT p_job_id, p_key, p_ordinal, p_kind,
               CASE WHEN EXISTS (SELECT 1 FROM event) THEN 'done' ELSE 'waiting' END,
               (SELECT payload::text FROM event),
               now() + make_interval(secs => p_seconds),
               CASE WHEN EXISTS (SELECT 1 FROM event) THEN now() END,
               p_request
        RETURNING checkpoints.status, checkpoints.value
    ), outbox_rows AS (
        INSERT INTO outbox (topic, dedupe_key, payload, workflow, job_id, trace_context)
        SELECT e.topic, e.dedupe_key, e.payload, p_workflow, p_job_id, p_trace_context
          FROM jsonb_to_recordset(p_effects) AS e (topic text, dedupe_key text, payload jsonb)
        ON CONFLICT (dedupe_key) DO NOTHING
    ), call_row AS (
        INSERT INTO outbox (topic, dedupe_key, payload, workflow, job_id, trace_context, call_key)
        SELECT p_call_topic, p_call_dedupe_key, p_call_payload, p_workflow, p_job_id,
               p_trace_context, p_key
         WHERE p_call_topic IS NOT NULL AND NOT EXISTS (SELECT 1 FROM event)
        ON CONFLICT (dedupe_key) DO UPDATE
           SET failed_at = NULL, attempts = 0, next_attempt_at = now(),
               locked_until = NULL, locked_by = NULL
         WHERE outbox.failed_at IS NOT NULL
    ), job AS (
        UPDATE jobs
           SET status = 'waiting', waiting_for = p_waiting_for, waiting_detail = p_detail,
               wait_until = now() + make_interval(secs => p_seconds), updated_at = now()
         WHERE job_id = p_job_id AND NOT EXISTS (SELECT 1 FROM event)
    ), delivery AS (
        INSERT INTO job_deliveries (job_id, delivery, consumer, started_at, outcome, model_calls)
        SELECT p_job_id, p_delivery, p_consumer, p_started_at, 'waiting', p_model_calls
         WHERE p_delivery IS NOT NULL AND NOT EXISTS (SELECT 1 FROM event)
    )
    SELECT w.status, w.value FROM wait w;
END
$$;

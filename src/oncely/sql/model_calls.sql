-- The usage ledger (oncely.usage.ledger owns the table).

-- name: insert_model_calls
-- One batch of calls, as one JSON document (psycopg converts one document
-- much faster than an array per column): ended calls' `sent` rows out,
-- calls in flight in as `sent` (once: a retried batch adds none twice),
-- ended calls in; a batch line's answer once however often its job read
-- it (its `call_id`, migration 0023).
WITH gone AS (
    DELETE FROM model_calls
     WHERE outcome = 'sent' AND call_id = ANY(%(ended)s::uuid[])
)
INSERT INTO model_calls (job_id, workflow, tenant, step, model, attempt, outcome,
                         prompt_tokens, completion_tokens, latency_ms, cost_usd, shadow,
                         created_at, cached_tokens, reasoning_tokens, call_id,
                         cache_write_tokens, dialect, cache_saved_usd, lane, lane_saved_usd)
SELECT c.job_id, c.workflow, c.tenant, c.step, c.model, c.attempt, c.outcome,
       c.prompt_tokens, c.completion_tokens, c.latency_ms, c.cost_usd, c.shadow,
       to_timestamp(c.at), coalesce(c.cached_tokens, 0), coalesce(c.reasoning_tokens, 0),
       c.call_id, coalesce(c.cache_write_tokens, 0), coalesce(c.dialect, 'chat'),
       c.cache_saved_usd, coalesce(c.lane, 'standard'), c.lane_saved_usd
  FROM jsonb_to_recordset(%(rows)s) AS c (job_id uuid, workflow text, tenant text, step text,
                                          model text, attempt integer, outcome text,
                                          prompt_tokens integer, completion_tokens integer,
                                          latency_ms integer, cost_usd numeric,
                                          shadow boolean, at double precision,
                                          cached_tokens integer, reasoning_tokens integer,
                                          call_id uuid, cache_write_tokens integer,
                                          dialect text, cache_saved_usd numeric,
                                          lane text, lane_saved_usd numeric)
    ON CONFLICT DO NOTHING

-- name: usage_report
-- Calls since a time, grouped by tenant, workflow, model, dialect, lane or UTC day. A call
-- is *productive* when it is the first answer of a job's model checkpoint
-- that is stored (a checkpoint row, or kept with the result), or an answer
-- of a shadow run; every other call is wasted: failures, re-asked answers,
-- and answers lost to a crash, a race, a cancel or a rerun. Unpriced calls
-- add nothing to the cost or the cache's savings (NULL when no call of the
-- group has a price).
WITH calls AS (
    SELECT c.id, c.job_id, c.step, c.outcome, c.shadow,
           c.prompt_tokens, c.completion_tokens, c.cost_usd,
           c.cached_tokens, c.cache_write_tokens, c.cache_saved_usd, c.lane_saved_usd,
           CASE %(by)s
               WHEN 'tenant' THEN c.tenant
               WHEN 'workflow' THEN c.workflow
               WHEN 'model' THEN c.model
               WHEN 'dialect' THEN c.dialect
               WHEN 'lane' THEN c.lane
               -- The console's table (workflow and dialect names hold no slash).
               WHEN 'workflow/dialect/model' THEN c.workflow || '/' || c.dialect || '/' || c.model
               ELSE to_char(c.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD')
           END AS grp
      FROM model_calls c
     WHERE c.created_at >= %(since)s
       AND (%(tenant)s::text IS NULL OR c.tenant = %(tenant)s)
), firsts AS (
    SELECT DISTINCT ON (job_id, step) id, job_id, step
      FROM calls
     WHERE outcome = 'ok' AND NOT shadow AND job_id IS NOT NULL
     ORDER BY job_id, step, id
), productive AS (
    SELECT f.id
      FROM firsts f
     WHERE EXISTS (SELECT 1 FROM checkpoints k
                    WHERE k.job_id = f.job_id AND k.key = f.step
                      AND k.kind = 'model' AND k.status = 'done')
        OR EXISTS (SELECT 1 FROM results r, jsonb_to_recordset(r.steps) AS s (key text, kind text)
                    WHERE r.job_id = f.job_id AND s.key = f.step AND s.kind = 'model')
)
SELECT c.grp,
       count(*) AS calls,
       coalesce(sum(c.prompt_tokens), 0) AS prompt_tokens,
       coalesce(sum(c.completion_tokens), 0) AS completion_tokens,
       sum(c.cost_usd) AS cost_usd,
       count(*) FILTER (WHERE p.id IS NULL AND NOT (c.shadow AND c.outcome = 'ok')) AS wasted_calls,
       coalesce(sum(c.cached_tokens), 0) AS cached_tokens,
       coalesce(sum(c.cache_write_tokens), 0) AS cache_write_tokens,
       sum(c.cache_saved_usd) AS cache_saved_usd,
       sum(c.lane_saved_usd) AS lane_saved_usd
  FROM calls c LEFT JOIN productive p USING (id)
 GROUP BY c.grp
 ORDER BY c.grp

-- name: prune_model_calls
-- Rows older than the ledger's retention (seconds, on PostgreSQL's clock), a
-- batch at a time.
DELETE FROM model_calls
 WHERE id IN (SELECT id FROM model_calls
               WHERE created_at < now() - make_interval(secs => %s)
               ORDER BY created_at LIMIT %s)

-- name: erase_tenant_model_calls
DELETE FROM model_calls WHERE tenant = %s

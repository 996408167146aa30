-- Statements on the shadow_results table, by name. Read with
-- oncely.sql.query("name"). Only oncely.shadow.store runs them.

-- name: shadow_result_stored
SELECT 1 FROM shadow_results WHERE job_id = %(job_id)s AND variant = %(variant)s

-- name: record_shadow_result
-- One row per job and variant: a redelivered or raced run that comes second
-- writes nothing. Only for a job that still exists (erased or purged while
-- the shadow ran: nothing to compare with).
INSERT INTO shadow_results
       (job_id, variant, workflow, result, emitted, usage, error, score, fields)
SELECT %(job_id)s, %(variant)s, %(workflow)s, %(result)s, %(emitted)s, %(usage)s,
       %(error)s, %(score)s, %(fields)s
 WHERE EXISTS (SELECT 1 FROM jobs WHERE job_id = %(job_id)s)
ON CONFLICT (job_id, variant) DO NOTHING
RETURNING job_id

-- name: shadow_report_totals
-- Per variant: runs, errors, pairs (a shadow result and a primary result),
-- their mean score, and per job of the pairs, the tokens, model calls and
-- model time of both sides.
WITH runs AS (
    SELECT s.variant, s.error, s.score, s.usage AS shadow_usage, r.usage AS primary_usage,
           s.error IS NULL AND r.job_id IS NOT NULL AS paired
      FROM shadow_results s LEFT JOIN results r USING (job_id)
     WHERE s.workflow = %(workflow)s
       AND (%(variant)s::text IS NULL OR s.variant = %(variant)s::text)
       AND s.created_at >= %(since)s
)
SELECT variant,
       count(*) AS runs,
       count(*) FILTER (WHERE error IS NOT NULL) AS errors,
       count(*) FILTER (WHERE paired) AS pairs,
       avg(score) FILTER (WHERE paired) AS agreement,
       avg(COALESCE((primary_usage ->> 'prompt_tokens')::float8, 0)
           + COALESCE((primary_usage ->> 'completion_tokens')::float8, 0))
           FILTER (WHERE paired) AS primary_tokens,
       avg(COALESCE((shadow_usage ->> 'prompt_tokens')::float8, 0)
           + COALESCE((shadow_usage ->> 'completion_tokens')::float8, 0))
           FILTER (WHERE paired) AS shadow_tokens,
       avg((primary_usage ->> 'model_calls')::float8) FILTER (WHERE paired) AS primary_calls,
       avg((shadow_usage ->> 'model_calls')::float8) FILTER (WHERE paired) AS shadow_calls,
       avg((primary_usage ->> 'model_ms')::float8) FILTER (WHERE paired) AS primary_ms,
       avg((shadow_usage ->> 'model_ms')::float8) FILTER (WHERE paired) AS shadow_ms
  FROM runs
 GROUP BY variant
 ORDER BY variant

-- name: shadow_report_fields
-- Per variant and field: the mean field score over the pairs.
SELECT s.variant, f.key, avg((f.value #>> '{}')::float8), count(*)
  FROM shadow_results s
  JOIN results r USING (job_id)
 CROSS JOIN LATERAL jsonb_each(s.fields) AS f
 WHERE s.workflow = %(workflow)s
   AND (%(variant)s::text IS NULL OR s.variant = %(variant)s::text)
   AND s.created_at >= %(since)s
   AND s.error IS NULL
 GROUP BY s.variant, f.key
 ORDER BY s.variant, f.key

-- name: shadow_report_scores
-- Per variant: how many pairs had each score (rounded to 0.01).
SELECT s.variant, round(s.score::numeric, 2)::float8 AS score, count(*)
  FROM shadow_results s
  JOIN results r USING (job_id)
 WHERE s.workflow = %(workflow)s
   AND (%(variant)s::text IS NULL OR s.variant = %(variant)s::text)
   AND s.created_at >= %(since)s
   AND s.error IS NULL
 GROUP BY 1, 2
 ORDER BY 1, 2

-- name: shadow_report_errors
-- Per variant: the most frequent errors (first 200 characters), with counts.
SELECT variant, error, n FROM (
    SELECT variant, left(error, 200) AS error, count(*) AS n,
           row_number() OVER (PARTITION BY variant ORDER BY count(*) DESC, left(error, 200))
               AS rank
      FROM shadow_results
     WHERE workflow = %(workflow)s
       AND (%(variant)s::text IS NULL OR variant = %(variant)s::text)
       AND created_at >= %(since)s
       AND error IS NOT NULL
     GROUP BY variant, left(error, 200)
) ranked
 WHERE rank <= %(limit)s
 ORDER BY variant, n DESC, error

-- Every statement oncely runs, by name. Read with oncely.sql.query("name").

-- name: create_migrations_table
CREATE TABLE IF NOT EXISTS oncely_migrations (
    version    integer     CONSTRAINT oncely_migrations_pkey PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)

-- name: applied_migrations
SELECT version FROM oncely_migrations ORDER BY version

-- name: record_migration
INSERT INTO oncely_migrations (version, name) VALUES (%s, %s)

-- name: insert_api_key
INSERT INTO api_keys (key_hash, tenant) VALUES (%s, %s)

-- name: revoke_api_key
UPDATE api_keys SET revoked_at = now()
 WHERE key_hash = %s AND revoked_at IS NULL
RETURNING tenant

-- name: tenant_for_key
SELECT tenant FROM api_keys WHERE key_hash = %s AND revoked_at IS NULL

-- name: insert_job
INSERT INTO jobs (job_id, tenant, payload) VALUES (%s, %s, %s)
ON CONFLICT (job_id) DO NOTHING

-- name: get_job
SELECT j.job_id, j.status, s.summary, j.error, j.created_at, j.updated_at
  FROM jobs j LEFT JOIN summaries s USING (job_id)
 WHERE j.job_id = %s AND j.tenant = %s

-- name: summary_exists
SELECT 1 FROM summaries WHERE job_id = %s

-- name: insert_summary
INSERT INTO summaries (job_id, summary) VALUES (%s, %s)
ON CONFLICT (job_id) DO NOTHING
RETURNING job_id

-- name: insert_outbox
INSERT INTO outbox (topic, dedupe_key, payload) VALUES (%s, %s, %s)
ON CONFLICT (dedupe_key) DO NOTHING

-- name: mark_job_done
UPDATE jobs SET status = 'done', error = NULL, updated_at = now() WHERE job_id = %s

-- name: mark_job_dead
UPDATE jobs SET status = 'dead', error = %s, updated_at = now()
 WHERE job_id = %s AND status = 'queued'

-- name: notify_outbox
SELECT pg_notify('oncely_outbox', '')

-- name: queued_jobs_older_than
SELECT job_id, tenant, payload FROM jobs
 WHERE status = 'queued' AND created_at < now() - make_interval(secs => %s)
 ORDER BY created_at
 LIMIT %s

-- name: mark_job_requeued
UPDATE jobs SET status = 'queued', error = NULL, updated_at = now() WHERE job_id = %s

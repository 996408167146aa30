-- Data lifecycle: finished jobs are deleted after ONCELY_JOB_RETENTION_S with
-- their results and outbox rows, and `oncely tenants erase` removes a
-- tenant's. These indexes keep both from scanning whole tables.

CREATE INDEX jobs_finished_updated_idx ON jobs (updated_at) WHERE status IN ('done', 'dead');
CREATE INDEX jobs_tenant_idx ON jobs (tenant);
CREATE INDEX outbox_job_id_idx ON outbox (job_id) WHERE job_id IS NOT NULL;
CREATE INDEX api_keys_tenant_idx ON api_keys (tenant);

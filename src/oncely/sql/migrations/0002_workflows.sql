-- Workflows: every job has a kind (its workflow's name), and the results of
-- every workflow live in one table. Existing summaries move into `results`
-- as {"summary": ...}; `summaries` stays readable as a view over them.

ALTER TABLE jobs ADD COLUMN kind text NOT NULL DEFAULT 'summaries';
-- From now on every insert names its workflow.
ALTER TABLE jobs ALTER COLUMN kind DROP DEFAULT;

-- The reconciler scans one workflow's waiting jobs at a time.
DROP INDEX jobs_queued_created_idx;
CREATE INDEX jobs_queued_kind_created_idx ON jobs (kind, created_at) WHERE status = 'queued';

CREATE TABLE results (
    job_id     uuid        CONSTRAINT results_pkey PRIMARY KEY
               CONSTRAINT results_job_id_fkey REFERENCES jobs (job_id),
    result     jsonb       NOT NULL,
    -- {"prompt_tokens", "completion_tokens", "model_calls"} of the delivery
    -- that stored the result; NULL for results stored before usage was kept.
    usage      jsonb,
    created_at timestamptz NOT NULL DEFAULT now()
);

INSERT INTO results (job_id, result, created_at)
SELECT job_id, jsonb_build_object('summary', summary), created_at FROM summaries;

DROP TABLE summaries;

CREATE VIEW summaries AS
SELECT r.job_id, r.result ->> 'summary' AS summary, r.created_at
  FROM results r JOIN jobs j USING (job_id)
 WHERE j.kind = 'summaries';

-- Which workflow and job an outbox row belongs to (NULL for rows written
-- before workflows, other than the summaries' own, which are backfilled).
ALTER TABLE outbox ADD COLUMN workflow text, ADD COLUMN job_id uuid;

UPDATE outbox
   SET workflow = 'summaries', job_id = (payload ->> 'job_id')::uuid
 WHERE topic = 'email.summary_ready'
   AND payload ->> 'job_id' ~ '^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$';

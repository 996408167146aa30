-- Shadow runs (README: "Trial a model change safely"): a variant's result
-- for a job, stored beside the primary's and never acted on. One row per
-- job and variant, whatever the deliveries. `result` and `score` are NULL
-- when the run failed (then `error` says why); `emitted` is what the step
-- would have emitted (never an outbox row); `usage` is what the run spent
-- ({"prompt_tokens", "completion_tokens", "model_calls", "model_ms"});
-- `fields` the score per field. Rows go with their job (retention, erasure).

CREATE TABLE shadow_results (
    job_id     uuid        NOT NULL
               CONSTRAINT shadow_results_job_id_fkey REFERENCES jobs (job_id) ON DELETE CASCADE,
    variant    text        NOT NULL,
    workflow   text        NOT NULL,
    result     jsonb,
    emitted    jsonb       NOT NULL DEFAULT '[]',
    usage      jsonb       NOT NULL,
    error      text,
    score      double precision,
    fields     jsonb       NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT shadow_results_pkey PRIMARY KEY (job_id, variant),
    CONSTRAINT shadow_results_outcome_check CHECK ((result IS NULL) <> (error IS NULL))
);

-- Reports read one workflow's rows (of one variant) since a time.
CREATE INDEX shadow_results_workflow_variant_created_idx
    ON shadow_results (workflow, variant, created_at);

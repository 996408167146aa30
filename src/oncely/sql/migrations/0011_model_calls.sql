-- The usage ledger (docs/model-routing.md): one row per model call that
-- reached a provider, answered or not, whatever became of its answer (kept
-- as a checkpoint, re-asked, lost to a crash or a race, cut by a timeout).
-- Workers write it in batches, off the path of the job.
--
-- `step`: the key of the model checkpoint the call was for; `attempt`: the
-- call's number within that checkpoint (retries, re-asks and fallbacks
-- count on). `cost_usd` is NULL for a model without a price
-- (ONCELY_LLM_PRICES). `shadow`: a shadow run's call, never a tenant's
-- spend. No foreign key to jobs: a job's rows outlive its retention (they
-- are what was paid), and go with their tenant's erasure.
CREATE TABLE model_calls (
    id                bigint      GENERATED ALWAYS AS IDENTITY
                      CONSTRAINT model_calls_pkey PRIMARY KEY,
    job_id            uuid,
    workflow          text        NOT NULL,
    tenant            text        NOT NULL,
    step              text,
    model             text        NOT NULL,
    attempt           integer     NOT NULL,
    outcome           text        NOT NULL
                      CONSTRAINT model_calls_outcome_check
                      CHECK (outcome IN ('ok', 'retryable', 'permanent', 'invalid_output', 'timeout')),
    prompt_tokens     integer     NOT NULL DEFAULT 0,
    completion_tokens integer     NOT NULL DEFAULT 0,
    latency_ms        integer     NOT NULL,
    cost_usd          numeric(20, 10),
    shadow            boolean     NOT NULL DEFAULT false,
    created_at        timestamptz NOT NULL
);

-- Reports read a time range; a tenant's day reads its own rows; a job's
-- calls are matched with its checkpoints (the wasted ones) and erased with it.
CREATE INDEX model_calls_created_at_idx ON model_calls (created_at);
CREATE INDEX model_calls_tenant_created_at_idx ON model_calls (tenant, created_at);
CREATE INDEX model_calls_job_id_idx ON model_calls (job_id);

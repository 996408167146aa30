-- The record of acceptance (jobs), the results (summaries), the outbox
-- the relay drains, and the API keys that map a bearer token to a tenant.

CREATE TABLE api_keys (
    key_hash   text        CONSTRAINT api_keys_pkey PRIMARY KEY,
    tenant     text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz
);

CREATE TABLE jobs (
    job_id     uuid        CONSTRAINT jobs_pkey PRIMARY KEY,
    tenant     text        NOT NULL,
    payload    jsonb       NOT NULL,
    status     text        NOT NULL DEFAULT 'queued'
               CONSTRAINT jobs_status_check CHECK (status IN ('queued', 'done', 'dead')),
    error      text,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- The reconciler scans only jobs still waiting.
CREATE INDEX jobs_queued_created_idx ON jobs (created_at) WHERE status = 'queued';

CREATE TABLE summaries (
    job_id     uuid        CONSTRAINT summaries_pkey PRIMARY KEY
               CONSTRAINT summaries_job_id_fkey REFERENCES jobs (job_id),
    summary    text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE outbox (
    id                  bigserial   CONSTRAINT outbox_pkey PRIMARY KEY,
    topic               text        NOT NULL,
    dedupe_key          text        NOT NULL CONSTRAINT outbox_dedupe_key_key UNIQUE,
    payload             jsonb       NOT NULL,
    attempts            integer     NOT NULL DEFAULT 0,
    last_error          text,
    next_attempt_at     timestamptz NOT NULL DEFAULT now(),
    locked_until        timestamptz,
    -- Owner token of the relay holding the lease: a relay whose lease
    -- expired cannot mark a row another relay now holds.
    locked_by           uuid,
    sent_at             timestamptz,
    failed_at           timestamptz,
    provider_message_id text,
    created_at          timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX outbox_due_idx ON outbox (next_attempt_at)
    WHERE sent_at IS NULL AND failed_at IS NULL;
CREATE INDEX outbox_sent_idx ON outbox (sent_at) WHERE sent_at IS NOT NULL;

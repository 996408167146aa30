-- The batch lane (docs/lanes.md): one row per model call that goes through
-- a provider's batch API, owned by oncely.llm.batches. A call's intent is
-- its row, stored with its `custom_id` (a digest of its job and its call's
-- checkpoint key, `call_key`: oncely.llm.lines.line_id) before any batch
-- exists; gathering lines into a batch stores that batch's oncely id
-- (`batch_id`, also in the provider batch's metadata where it keeps any)
-- and the time (`gathered_at`) on them before the batch is created, and the
-- provider's id (`provider_id`) is recorded once it is: a batch gathered
-- but not recorded is found (by its metadata, else by its size and time)
-- and adopted, never created twice. `lease_until`: while a process creates
-- or polls the line's batch, no other does.
CREATE TABLE IF NOT EXISTS batch_lines (
    custom_id   text        CONSTRAINT batch_lines_pkey PRIMARY KEY,
    job_id      uuid        NOT NULL,
    call_key    text        NOT NULL,
    workflow    text        NOT NULL,
    tenant      text        NOT NULL DEFAULT '',
    model       text        NOT NULL,
    dialect     text        NOT NULL DEFAULT 'chat',
    body        jsonb       NOT NULL,
    status      text        NOT NULL DEFAULT 'waiting'
                CONSTRAINT batch_lines_status_check
                CHECK (status IN ('waiting', 'gathered', 'answered', 'failed', 'dropped')),
    batch_id    uuid,
    provider_id text,
    lease_until timestamptz,
    gathered_at timestamptz,
    submissions integer     NOT NULL DEFAULT 0,
    answer      jsonb,
    error       jsonb,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS batch_lines_waiting_idx
    ON batch_lines (model, dialect, created_at) WHERE status = 'waiting';
CREATE INDEX IF NOT EXISTS batch_lines_gathered_idx
    ON batch_lines (batch_id) WHERE status = 'gathered';
CREATE INDEX IF NOT EXISTS batch_lines_batch_idx ON batch_lines (batch_id);
CREATE INDEX IF NOT EXISTS batch_lines_provider_idx ON batch_lines (provider_id);

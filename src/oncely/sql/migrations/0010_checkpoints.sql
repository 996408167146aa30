-- Multi-step workflows (docs/durable-steps.md): a job's checkpoints, the
-- events sent to it, and its waiting state.
--
-- A job may now also be `waiting` (for an event or a time: it holds no
-- stream entry and no worker slot) or `cancelled` (nothing more is written
-- for it). The constraint is added NOT VALID then validated, so the scan
-- of existing rows does not hold the table's exclusive lock.

ALTER TABLE jobs DROP CONSTRAINT jobs_status_check;
ALTER TABLE jobs ADD CONSTRAINT jobs_status_check
    CHECK (status IN ('queued', 'done', 'dead', 'withdrawn', 'waiting', 'cancelled')) NOT VALID;
ALTER TABLE jobs VALIDATE CONSTRAINT jobs_status_check;

-- `wait_until`: when a waiting job resumes on its own (the wait's timeout,
-- the sleep's end). `waiting_for`: the event it waits for (NULL: a sleep).
-- `resumed_at`: its last resume (an event, a timer, a rewind); the
-- reconciler counts a resumed job's age from it. `generation`: bumped when
-- an operator reruns the job, so that a delivery of an earlier run can
-- write nothing more. Constant defaults: no table rewrite.
ALTER TABLE jobs
    ADD COLUMN wait_until timestamptz,
    ADD COLUMN waiting_for text,
    ADD COLUMN resumed_at timestamptz,
    ADD COLUMN generation integer NOT NULL DEFAULT 0;

-- The timer service finds due jobs, and /metrics counts waiting ones, without a scan.
CREATE INDEX jobs_waiting_until_idx ON jobs (wait_until) WHERE status = 'waiting';

-- One row per checkpoint a job's run reached: a step's value, a model
-- call's answer, a wait's event, a sleep. `key` is unique per job (the
-- first writer wins); `ordinal` is the order the run reached it, unique
-- too, so that a run asking for another key at a stored ordinal is caught.
-- `value` is JSON text (not jsonb: a model's answer may hold what jsonb
-- refuses, NUL among it, which JSON text escapes), SQL NULL only while
-- `waiting`; a wait that timed out and a sleep that ended hold JSON null. A
-- `failed` checkpoint is work that failed and that the run went on past:
-- its value is {"error", "message", "transient"}, raised again on replay.
CREATE TABLE checkpoints (
    job_id      uuid        NOT NULL
                CONSTRAINT checkpoints_job_id_fkey REFERENCES jobs (job_id) ON DELETE CASCADE,
    key         text        NOT NULL,
    ordinal     integer     NOT NULL,
    kind        text        NOT NULL
                CONSTRAINT checkpoints_kind_check CHECK (kind IN ('step', 'model', 'wait', 'sleep')),
    status      text        NOT NULL
                CONSTRAINT checkpoints_status_check
                CHECK (status IN ('done', 'waiting', 'failed')),
    value       text,
    -- Model checkpoints: {"prompt_tokens", "completion_tokens", "model_calls", "model_ms"}.
    usage       jsonb,
    -- Waits and sleeps: when the wait times out, or the sleep ends.
    until       timestamptz,
    created_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    CONSTRAINT checkpoints_pkey PRIMARY KEY (job_id, key),
    CONSTRAINT checkpoints_ordinal_key UNIQUE (job_id, ordinal),
    CONSTRAINT checkpoints_value_check CHECK ((value IS NULL) = (status = 'waiting'))
);

-- Events sent to a job (POST <route>/{job_id}/events/{name}): at most one
-- per name, kept whether or not the job waits for it yet.
CREATE TABLE job_events (
    job_id      uuid        NOT NULL
                CONSTRAINT job_events_job_id_fkey REFERENCES jobs (job_id) ON DELETE CASCADE,
    name        text        NOT NULL,
    payload     jsonb       NOT NULL,
    -- sha256 of the event's canonical JSON: the same event again is not a conflict.
    fingerprint text        NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT job_events_pkey PRIMARY KEY (job_id, name)
);

-- The checkpoints a run reached last, written with its result: a done job
-- never runs again, so they are kept in its row ({"key", "ordinal", "kind",
-- "status", "usage"}, no value), not as checkpoint rows. NULL for results
-- stored before.
ALTER TABLE results ADD COLUMN steps jsonb;

-- A delivery may now end at a wait or a sleep.
ALTER TABLE job_deliveries DROP CONSTRAINT job_deliveries_outcome_check;
ALTER TABLE job_deliveries ADD CONSTRAINT job_deliveries_outcome_check
    CHECK (outcome IN ('done', 'duplicate', 'retry', 'dead', 'cancelled', 'waiting')) NOT VALID;
ALTER TABLE job_deliveries VALIDATE CONSTRAINT job_deliveries_outcome_check;

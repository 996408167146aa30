-- A job's deliveries, as operators see them in its detail: one row per
-- delivery that reported back. The successful one is written by the same
-- statement that stores the result (finish_job); a failed one when the worker
-- settles it (redelivered later, dead-lettered, or cancelled). A delivery
-- whose worker was killed never reports: no row, and its number is skipped.
-- `delivery` counts the job's deliveries since it was last enqueued by the
-- intake, an operator's replay or the reconciler (1 = the first).

CREATE TABLE job_deliveries (
    job_id      uuid        NOT NULL
                CONSTRAINT job_deliveries_job_id_fkey REFERENCES jobs (job_id),
    id          bigint      GENERATED ALWAYS AS IDENTITY,
    delivery    integer     NOT NULL,
    consumer    text        NOT NULL,
    started_at  timestamptz NOT NULL,
    finished_at timestamptz NOT NULL DEFAULT now(),
    outcome     text        NOT NULL
                CONSTRAINT job_deliveries_outcome_check
                CHECK (outcome IN ('done', 'duplicate', 'retry', 'dead', 'cancelled')),
    error       text,
    model_calls integer     NOT NULL DEFAULT 0,
    -- One index serves a job's history, retention and erasure.
    CONSTRAINT job_deliveries_pkey PRIMARY KEY (job_id, id)
);

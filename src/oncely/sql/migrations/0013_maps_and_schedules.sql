-- Fan-out and schedules (docs/fanout.md).
--
-- A child job of a map (`ctx.map`) knows its parent, the key of the
-- parent's map checkpoint and its position among the items; `held`: a
-- child not yet released (the map's concurrency is taken), as GET shows
-- it `queued`. `map_counted`: its end was counted in its map (job_maps),
-- so that counting it again changes nothing.
ALTER TABLE jobs
    ADD COLUMN parent_id uuid,
    ADD COLUMN parent_key text,
    ADD COLUMN position integer,
    ADD COLUMN map_counted boolean NOT NULL DEFAULT false;
ALTER TABLE jobs DROP CONSTRAINT jobs_status_check;
ALTER TABLE jobs ADD CONSTRAINT jobs_status_check
    CHECK (status IN ('queued', 'done', 'dead', 'withdrawn', 'waiting', 'cancelled', 'held'))
    NOT VALID;
ALTER TABLE jobs VALIDATE CONSTRAINT jobs_status_check;

-- One row per map: how many children it has released so far (in item
-- order: those before `released` were queued, the rest are held), how many
-- ended and how, and their usage summed once every child has ended. Its
-- update is the lock that orders siblings ending together. Goes with the
-- parent.
CREATE TABLE job_maps (
    parent_id   uuid        NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
    key         text        NOT NULL,
    workflow    text        NOT NULL,
    total       integer     NOT NULL,
    concurrency integer     NOT NULL,
    released    integer     NOT NULL,
    done        integer     NOT NULL DEFAULT 0,
    dead        integer     NOT NULL DEFAULT 0,
    cancelled   integer     NOT NULL DEFAULT 0,
    usage       jsonb,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    CONSTRAINT job_maps_pkey PRIMARY KEY (parent_id, key)
);

-- A workflow's schedule: the last tick a job was started for, claimed by
-- one process of the fleet (the row's update), and that job.
CREATE TABLE schedules (
    workflow    text        CONSTRAINT schedules_pkey PRIMARY KEY,
    expression  text        NOT NULL,
    last_tick   timestamptz,
    last_job_id uuid,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

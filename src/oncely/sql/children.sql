-- Statements on maps (`ctx.map`, docs/fanout.md): the job_maps table and
-- the child jobs' map columns (parent_id, parent_key, position, held,
-- map_counted), by name. Read with oncely.sql.query("name"). Only
-- oncely.jobs.children runs them.
--
-- A map's row is the lock its children's ends take, so siblings ending
-- together are counted one after the other; its counts decide what is
-- released next and when the map ends. A child's end is counted once
-- (`map_counted`), whoever counts it: the worker that ended it, the API
-- that cancelled it, or the repair pass.

-- name: create_map
-- The first statement of a map's own part of the parent's wait
-- transaction: its row, unless a run before created it (answers nothing).
INSERT INTO job_maps (parent_id, key, workflow, total, concurrency, active, held)
VALUES (%(job_id)s, %(key)s, %(kind)s, %(total)s, %(concurrency)s,
        LEAST(%(total)s, %(concurrency)s), GREATEST(%(total)s - %(concurrency)s, 0))
ON CONFLICT (parent_id, key) DO NOTHING
RETURNING parent_id

-- name: insert_children
-- Every child, the first `concurrency` queued and the rest held; answers
-- the queued ones, to enqueue after the commit.
WITH children AS (
    INSERT INTO jobs (job_id, tenant, kind, payload, status, parent_id, parent_key, position)
    SELECT c.job_id, %(tenant)s, %(kind)s, c.payload,
           CASE WHEN c.position < %(concurrency)s THEN 'queued' ELSE 'held' END,
           %(job_id)s, %(key)s, c.position
      FROM jsonb_to_recordset(%(children)s) AS c (job_id uuid, position integer, payload jsonb)
    ON CONFLICT (job_id) DO NOTHING
    RETURNING job_id, tenant, kind, payload, status
)
SELECT job_id, tenant, kind, payload FROM children WHERE status = 'queued'

-- name: count_ended_children
-- These jobs, those that are children that ended (done, dead, cancelled)
-- and were not counted yet, counted in their maps; answers each unfinished
-- map touched with its counts, its row locked until the commit.
WITH ended AS (
    UPDATE jobs SET map_counted = true
     WHERE job_id = ANY(%(job_ids)s::uuid[]) AND parent_id IS NOT NULL AND NOT map_counted
       AND status IN ('done', 'dead', 'cancelled')
    RETURNING parent_id, parent_key, status
), tally AS (
    SELECT parent_id, parent_key, count(*) AS n,
           count(*) FILTER (WHERE status = 'done') AS done,
           count(*) FILTER (WHERE status = 'dead') AS dead,
           count(*) FILTER (WHERE status = 'cancelled') AS cancelled
      FROM ended GROUP BY parent_id, parent_key
)
UPDATE job_maps m
   SET active = m.active - t.n, done = m.done + t.done, dead = m.dead + t.dead,
       cancelled = m.cancelled + t.cancelled, updated_at = now()
  FROM tally t
 WHERE m.parent_id = t.parent_id AND m.key = t.parent_key AND m.finished_at IS NULL
RETURNING m.parent_id, m.key, m.concurrency, m.active, m.held

-- name: release_children
-- Up to `n` held children of the map queued, in item order (answered, to
-- enqueue after the commit); the map's counts follow. `resumed_at`: the
-- reconciler counts a released child's age from its release.
WITH next AS (
    SELECT job_id FROM jobs
     WHERE parent_id = %(parent_id)s AND parent_key = %(key)s AND status = 'held'
     ORDER BY position
     LIMIT %(n)s
       FOR NO KEY UPDATE
), released AS (
    UPDATE jobs j SET status = 'queued', resumed_at = now(), updated_at = now()
      FROM next WHERE j.job_id = next.job_id
    RETURNING j.job_id, j.tenant, j.kind, j.payload
), counts AS (
    UPDATE job_maps
       SET active = active + (SELECT count(*) FROM released),
           held = held - (SELECT count(*) FROM released)
     WHERE parent_id = %(parent_id)s AND key = %(key)s
)
SELECT job_id, tenant, kind, payload FROM released

-- name: map_children
-- A map's children in item order, with their results and usage.
SELECT j.job_id, j.status, j.error, r.result, r.usage
  FROM jobs j LEFT JOIN results r USING (job_id)
 WHERE j.parent_id = %(parent_id)s AND j.parent_key = %(key)s
 ORDER BY j.position

-- name: end_map
-- Every child of the map ended: the results in item order are the event
-- `map:<key>` (what a rewound parent reaching the map again gets) and the
-- map checkpoint's value, its usage the children's; the parent, if it
-- waits on the map, queued again (returned, to be enqueued).
WITH map AS (
    UPDATE job_maps SET finished_at = now(), updated_at = now(), usage = %(usage)s
     WHERE parent_id = %(parent_id)s AND key = %(key)s AND finished_at IS NULL
    RETURNING parent_id
), event AS (
    INSERT INTO job_events (job_id, name, payload, fingerprint)
    SELECT parent_id, 'map:' || %(key)s, %(results)s, 'map' FROM map
    ON CONFLICT DO NOTHING
), wait AS (
    UPDATE checkpoints c
       SET status = 'done', value = (%(results)s)::text, usage = %(checkpoint_usage)s,
           finished_at = now()
      FROM map
     WHERE c.job_id = map.parent_id AND c.key = %(key)s AND c.kind = 'map'
       AND c.status = 'waiting'
    RETURNING c.job_id
)
UPDATE jobs
   SET status = 'queued', waiting_for = NULL, waiting_detail = NULL, wait_until = NULL,
       resumed_at = now(), updated_at = now()
 WHERE job_id IN (SELECT job_id FROM wait) AND status = 'waiting'
RETURNING job_id, tenant, kind, payload

-- name: lock_map
-- The first statement of a recount: the map's row, locked, if unfinished.
SELECT concurrency FROM job_maps
 WHERE parent_id = %(parent_id)s AND key = %(key)s AND finished_at IS NULL
   FOR NO KEY UPDATE

-- name: recount_map
-- A map's counts read again from its children (a rewound parent's map, or
-- one whose count was lost); every child marked counted iff it ended.
WITH marked AS (
    UPDATE jobs SET map_counted = status IN ('done', 'dead', 'cancelled')
     WHERE parent_id = %(parent_id)s AND parent_key = %(key)s
       AND map_counted <> (status IN ('done', 'dead', 'cancelled'))
), counts AS (
    SELECT count(*) FILTER (WHERE status IN ('queued', 'waiting')) AS active,
           count(*) FILTER (WHERE status = 'held') AS held,
           count(*) FILTER (WHERE status = 'done') AS done,
           count(*) FILTER (WHERE status = 'dead') AS dead,
           count(*) FILTER (WHERE status = 'cancelled') AS cancelled
      FROM jobs WHERE parent_id = %(parent_id)s AND parent_key = %(key)s
)
UPDATE job_maps m
   SET active = c.active, held = c.held, done = c.done, dead = c.dead,
       cancelled = c.cancelled, updated_at = now()
  FROM counts c
 WHERE m.parent_id = %(parent_id)s AND m.key = %(key)s
RETURNING m.parent_id, m.key, m.concurrency, m.active, m.held

-- name: uncounted_children
-- Children that ended a while ago and were never counted (the process that
-- ended them died first): the repair pass counts them.
SELECT job_id FROM jobs
 WHERE parent_id IS NOT NULL AND NOT map_counted
   AND status IN ('done', 'dead', 'cancelled')
   AND updated_at < now() - make_interval(secs => %(age_s)s)
 LIMIT %(limit)s

-- name: cancel_children
-- A cancelled parent's unfinished children cancelled; answers them with
-- the status they had (a queued one may be running: its worker is told).
WITH target AS (
    SELECT job_id, status FROM jobs
     WHERE parent_id = %(parent_id)s AND status IN ('queued', 'waiting', 'held')
       FOR NO KEY UPDATE
), cancelled AS (
    UPDATE jobs j
       SET status = 'cancelled', waiting_for = NULL, waiting_detail = NULL, wait_until = NULL,
           map_counted = true, updated_at = now()
      FROM target t WHERE j.job_id = t.job_id
)
SELECT t.job_id, t.status, j.kind FROM target t JOIN jobs j USING (job_id)

-- name: map_counts
-- What a parent's maps count now, for GET (`waiting.children`).
SELECT key, workflow, total, active, held, done, dead, cancelled, finished_at
  FROM job_maps WHERE parent_id = %(parent_id)s ORDER BY created_at

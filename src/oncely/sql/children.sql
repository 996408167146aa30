-- Statements on maps (`ctx.map`, docs/fanout.md): the job_maps table and
-- the child jobs' map columns (parent_id, parent_key, position, held,
-- map_counted), by name. Read with oncely.sql.query("name"). Only
-- oncely.jobs.children runs them.
--
-- Children are released in item order: those before the map's `released`
-- were queued, the rest are held. A child's end is counted once
-- (`map_counted`), whoever counts it (the worker that ended it, the API
-- that cancelled it, the repair pass), in one statement that also moves
-- `released` on and queues what it passed: the map's row is updated under
-- its lock, so siblings ending together are counted one after the other,
-- and a held child another count released meanwhile fails the `held`
-- check on its newest version and is skipped. At most `concurrency`
-- children are released and not ended at any time.

-- name: create_map
-- The first statement of a map's own part of the parent's wait
-- transaction: its row, unless a run before created it (answers nothing).
INSERT INTO job_maps (parent_id, key, workflow, total, concurrency, released)
VALUES (%(job_id)s, %(key)s, %(kind)s, %(total)s, %(concurrency)s,
        LEAST(%(total)s, %(concurrency)s))
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
-- and were not counted yet, counted in their maps, and as many held
-- children released as their ends leave room for. One statement, no
-- transaction around it. Answers the children released (to enqueue) and
-- the maps every child of which has now ended (to end).
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
), counted AS (
    UPDATE job_maps m
       SET done = m.done + t.done, dead = m.dead + t.dead, cancelled = m.cancelled + t.cancelled,
           released = GREATEST(m.released, LEAST(
               m.total, m.done + m.dead + m.cancelled + t.n + m.concurrency)),
           updated_at = now()
      FROM tally t
     WHERE m.parent_id = t.parent_id AND m.key = t.parent_key AND m.finished_at IS NULL
    RETURNING m.parent_id, m.key, m.released, m.total, m.done + m.dead + m.cancelled AS ended
), released AS (
    UPDATE jobs j SET status = 'queued', resumed_at = now(), updated_at = now()
      FROM counted c
     WHERE j.parent_id = c.parent_id AND j.parent_key = c.key AND j.status = 'held'
       AND j.position < c.released
    RETURNING j.job_id, j.tenant, j.kind, j.payload
)
SELECT (SELECT coalesce(json_agg(json_build_array(job_id, tenant, kind, payload)), '[]')
          FROM released),
       (SELECT coalesce(json_agg(json_build_array(parent_id, key)), '[]')
          FROM counted WHERE ended >= total)

-- name: recount_map
-- A map's counts read again from its children (a rewound parent's map, or
-- one whose count was lost), every child marked counted iff it ended, and
-- what that leaves room for released. Answers as count_ended_children.
WITH marked AS (
    UPDATE jobs SET map_counted = status IN ('done', 'dead', 'cancelled')
     WHERE parent_id = %(parent_id)s AND parent_key = %(key)s
       AND map_counted <> (status IN ('done', 'dead', 'cancelled'))
), rows AS (
    SELECT count(*) FILTER (WHERE status = 'done') AS done,
           count(*) FILTER (WHERE status = 'dead') AS dead,
           count(*) FILTER (WHERE status = 'cancelled') AS cancelled,
           count(*) FILTER (WHERE status <> 'held') AS out
      FROM jobs WHERE parent_id = %(parent_id)s AND parent_key = %(key)s
), counted AS (
    UPDATE job_maps m
       SET done = r.done, dead = r.dead, cancelled = r.cancelled,
           released = GREATEST(r.out, LEAST(m.total, r.done + r.dead + r.cancelled + m.concurrency)),
           updated_at = now()
      FROM rows r
     WHERE m.parent_id = %(parent_id)s AND m.key = %(key)s AND m.finished_at IS NULL
    RETURNING m.parent_id, m.key, m.released, m.total, m.done + m.dead + m.cancelled AS ended
), released AS (
    UPDATE jobs j SET status = 'queued', resumed_at = now(), updated_at = now()
      FROM counted c
     WHERE j.parent_id = c.parent_id AND j.parent_key = c.key AND j.status = 'held'
       AND j.position < c.released
    RETURNING j.job_id, j.tenant, j.kind, j.payload
)
SELECT (SELECT coalesce(json_agg(json_build_array(job_id, tenant, kind, payload)), '[]')
          FROM released),
       (SELECT coalesce(json_agg(json_build_array(parent_id, key)), '[]')
          FROM counted WHERE ended >= total)

-- name: lock_unfinished_map
-- The first statement of a map's end: its row, locked, if not ended yet.
SELECT 1 FROM job_maps
 WHERE parent_id = %(parent_id)s AND key = %(key)s AND finished_at IS NULL
   FOR NO KEY UPDATE

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

-- name: uncounted_children
-- Children that ended a while ago and were never counted (the process that
-- ended them died first): the repair pass counts them.
SELECT job_id FROM jobs
 WHERE parent_id IS NOT NULL AND NOT map_counted
   AND status IN ('done', 'dead', 'cancelled')
   AND updated_at < now() - make_interval(secs => %(age_s)s)
 LIMIT %(limit)s

-- name: unended_maps
-- Maps every child of which ended a while ago that were never ended (the
-- process that counted the last one died first): the repair pass ends them.
SELECT parent_id, key FROM job_maps
 WHERE finished_at IS NULL AND done + dead + cancelled >= total
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
-- What a parent's maps count now, for operators.
SELECT key, workflow, total, released, done, dead, cancelled, finished_at
  FROM job_maps WHERE parent_id = %(parent_id)s ORDER BY created_at

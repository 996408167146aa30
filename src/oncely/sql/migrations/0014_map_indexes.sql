-- oncely: no-transaction
-- The children of maps, built without locking the jobs table against
-- writes: every child in item order (a map's results, a cancel), held
-- children in release order, and children whose end is not yet counted
-- (the repair pass finds them; counted ones leave that index). Jobs that
-- are nobody's children are in none of them.
CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_children_idx
    ON jobs (parent_id, parent_key, position) WHERE parent_id IS NOT NULL;
CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_held_children_idx
    ON jobs (parent_id, parent_key, position) WHERE status = 'held';
CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_uncounted_children_idx
    ON jobs (updated_at) WHERE parent_id IS NOT NULL AND NOT map_counted;

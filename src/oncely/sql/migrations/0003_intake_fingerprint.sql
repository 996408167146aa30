-- The intake's own record on each job row: the request's fingerprint (so a
-- reused Idempotency-Key with another body is 422 even after Redis forgot
-- the key) and the accepting attempt's token (which attempt a `withdrawn`
-- row fences off). Both NULL for rows accepted before this migration.
-- `withdrawn`: an intake answered 503 whose insert may have landed; such a
-- row never runs, reads as 404, and a retry with the same key takes it over.

ALTER TABLE jobs ADD COLUMN fingerprint text, ADD COLUMN intake_token uuid;

ALTER TABLE jobs DROP CONSTRAINT jobs_status_check;
ALTER TABLE jobs ADD CONSTRAINT jobs_status_check
    CHECK (status IN ('queued', 'done', 'dead', 'withdrawn'));

-- Retention finds the withdrawn rows without a scan.
CREATE INDEX jobs_withdrawn_updated_idx ON jobs (updated_at) WHERE status = 'withdrawn';

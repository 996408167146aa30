-- Which intake attempts touched a job row, so that withdrawing an attempt
-- answered 503 never withdraws a row that another attempt was answered 202
-- for. `intake_token` stays the attempt that wrote the row; `adopters` are
-- the later attempts (same key, same body) that found it queued and answered
-- from it; `unanswered` are the attempts withdrawn so far. A queued row is
-- withdrawn only once every attempt that touched it is unanswered. Rows
-- written before this migration (token NULL) count as answered.
-- Constant defaults: no table rewrite.

ALTER TABLE jobs
    ADD COLUMN adopters uuid[] NOT NULL DEFAULT '{}',
    ADD COLUMN unanswered uuid[] NOT NULL DEFAULT '{}';

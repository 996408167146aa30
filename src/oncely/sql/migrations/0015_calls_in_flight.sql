-- oncely: no-transaction
-- The ledger writes a call that is still in flight as `sent` (no tokens
-- yet), and replaces that row when the call ends: a process killed mid-call
-- leaves a row for what the provider may bill (docs/model-routing.md).
-- `call_id` names an in-flight call's row; only `sent` rows have one, so
-- their index stays as small as the calls in flight.
ALTER TABLE model_calls ADD COLUMN IF NOT EXISTS call_id uuid;
ALTER TABLE model_calls
    DROP CONSTRAINT IF EXISTS model_calls_outcome_check,
    ADD CONSTRAINT model_calls_outcome_check
        CHECK (outcome IN ('ok', 'retryable', 'permanent', 'invalid_output', 'timeout', 'sent'))
        NOT VALID;
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS model_calls_sent_idx
    ON model_calls (call_id) WHERE outcome = 'sent';

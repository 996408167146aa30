-- oncely: no-transaction
-- Providers and dialects (docs/providers.md). Each ledger row names how the
-- call was spoken (`chat`: OpenAI chat completions, `anthropic`: Anthropic's
-- Messages API), counts the prompt tokens the provider wrote to its cache
-- (Anthropic's cache writes; reads are `cached_tokens`), and a call the
-- model declined to answer is `refused`. The constraint is added NOT VALID
-- then validated, so the scan of existing rows does not hold the table's
-- exclusive lock; the new columns' constant defaults rewrite nothing.
ALTER TABLE model_calls
    ADD COLUMN IF NOT EXISTS dialect text NOT NULL DEFAULT 'chat',
    ADD COLUMN IF NOT EXISTS cache_write_tokens integer NOT NULL DEFAULT 0;
ALTER TABLE model_calls
    DROP CONSTRAINT IF EXISTS model_calls_outcome_check,
    ADD CONSTRAINT model_calls_outcome_check
        CHECK (outcome IN ('ok', 'retryable', 'permanent', 'invalid_output', 'timeout', 'refused',
                           'sent'))
        NOT VALID;
ALTER TABLE model_calls VALIDATE CONSTRAINT model_calls_outcome_check;

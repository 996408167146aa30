-- Cheaper lanes (docs/lanes.md): each ledger row names how the call went
-- (`standard`, `flex`: OpenAI's flex tier, `batch`: a provider's batch API)
-- and what its lane saved against the standard price, at the prices the
-- call was recorded with (NULL: unpriced, or recorded before this column).
-- A constant default and a nullable column rewrite nothing.
ALTER TABLE model_calls
    ADD COLUMN IF NOT EXISTS lane text NOT NULL DEFAULT 'standard',
    ADD COLUMN IF NOT EXISTS lane_saved_usd numeric(20, 10);

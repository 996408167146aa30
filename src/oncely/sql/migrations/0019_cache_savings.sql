-- What the provider's cache saved each call (docs/model-routing.md): its
-- prompt at the model's full input price less what it cost, at the prices
-- the call was recorded with (ONCELY_LLM_PRICES' cache-read and cache-write
-- prices), as `cost_usd` is. NULL: unpriced, or recorded before this column.
-- Negative when the writes cost more than the reads saved. A nullable column
-- without a default rewrites nothing.
ALTER TABLE model_calls ADD COLUMN IF NOT EXISTS cache_saved_usd numeric(20, 10);

-- oncely: no-transaction
-- A batch line's answer is in the ledger once (docs/lanes.md): a job whose
-- delivery died after reading its answered line and before storing the
-- call's checkpoint reads it again, and records the same row, named by the
-- line and its submission (`oncely.llm.batches.Line.call_id`). Only batch
-- rows carry such a name, so the index stays as small as the batch lane.
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS model_calls_batch_idx
    ON model_calls (call_id) WHERE lane = 'batch';

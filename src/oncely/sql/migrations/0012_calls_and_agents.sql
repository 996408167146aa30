-- Calls that answer, tools and approvals (docs/agents.md), and the kinds of
-- checkpoint later features store.
--
-- A checkpoint may now also be a function tool's run (`tool`), a call
-- whose receiver's answer is its value (`call`), a person's decision on a
-- tool call (`approval`), the marker of a patched code path (`patch`) and
-- a map over child jobs (`map`). The constraint is added NOT VALID then
-- validated, so the scan of existing rows does not hold the table's
-- exclusive lock.
ALTER TABLE checkpoints DROP CONSTRAINT checkpoints_kind_check;
ALTER TABLE checkpoints ADD CONSTRAINT checkpoints_kind_check
    CHECK (kind IN ('step', 'model', 'wait', 'sleep', 'tool', 'call', 'approval', 'patch', 'map'))
    NOT VALID;
ALTER TABLE checkpoints VALIDATE CONSTRAINT checkpoints_kind_check;

-- A call's outbox row: `call_key` is the key of the job's checkpoint its
-- answer goes to (NULL for a plain effect), `answer` the receiver's answer
-- as it was stored (JSON), kept with the row so that a rewound job reaching
-- the call again gets the same answer without a second send.
ALTER TABLE outbox
    ADD COLUMN call_key text,
    ADD COLUMN answer jsonb;

-- What a waiting job waits on, as GET shows it beside `waiting_for` (the
-- name its wake-up is matched on): {"call": topic}, {"approval": {"call_id",
-- "tool", "arguments"}}, ... NULL for an event or a sleep.
ALTER TABLE jobs ADD COLUMN waiting_detail jsonb;

-- The ledger's calls: of their prompt tokens, those a provider served from
-- its cache (priced apart when ONCELY_LLM_PRICES says so), and of their
-- completion tokens, those spent reasoning (0 when not reported).
ALTER TABLE model_calls
    ADD COLUMN cached_tokens integer NOT NULL DEFAULT 0,
    ADD COLUMN reasoning_tokens integer NOT NULL DEFAULT 0;

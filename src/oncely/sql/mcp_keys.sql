-- Statements on oncely_mcp_keys, the table oncely.mcp.idempotent keeps in
-- an MCP server's own database (docs/mcp.md, "Servers you own"): one row per
-- idempotency key, written in the transaction that ran its call. Read with
-- oncely.sql.query("name").

-- name: mcp_keys_create
CREATE TABLE IF NOT EXISTS oncely_mcp_keys (
    key         text PRIMARY KEY,
    fingerprint text NOT NULL,
    result      jsonb,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS oncely_mcp_keys_created_at ON oncely_mcp_keys (created_at)

-- name: mcp_key_claim
-- The key for this call: a new row, or an expired one taken over. A row
-- another transaction inserted and has not committed makes this wait for it
-- (a concurrent repeat waits for the first call); no row back: the key is
-- someone else's, committed with its result.
INSERT INTO oncely_mcp_keys (key, fingerprint) VALUES (%(key)s, %(fingerprint)s)
ON CONFLICT (key) DO UPDATE
   SET fingerprint = EXCLUDED.fingerprint, result = NULL, created_at = now()
 WHERE oncely_mcp_keys.created_at < now() - make_interval(secs => %(ttl_s)s)
RETURNING key

-- name: mcp_key_stored
SELECT fingerprint, result FROM oncely_mcp_keys WHERE key = %(key)s

-- name: mcp_key_done
UPDATE oncely_mcp_keys SET result = %(result)s WHERE key = %(key)s

-- name: mcp_keys_sweep
DELETE FROM oncely_mcp_keys WHERE created_at < now() - make_interval(secs => %(ttl_s)s)

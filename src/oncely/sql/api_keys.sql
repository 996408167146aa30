-- Statements on the api_keys table, by name. Read with oncely.sql.query("name").

-- name: insert_api_key
INSERT INTO api_keys (key_hash, tenant) VALUES (%s, %s)
RETURNING id

-- name: revoke_api_key
UPDATE api_keys SET revoked_at = now()
 WHERE key_hash = %s AND revoked_at IS NULL
RETURNING tenant

-- name: tenant_for_key
-- The tenant of an active key; `last_used_at` is refreshed at most once a
-- minute, so most lookups write nothing.
WITH touched AS (
    UPDATE api_keys SET last_used_at = now()
     WHERE key_hash = %(key_hash)s AND revoked_at IS NULL
       AND (last_used_at IS NULL OR last_used_at < now() - interval '1 minute')
)
SELECT tenant FROM api_keys WHERE key_hash = %(key_hash)s AND revoked_at IS NULL

-- name: revoke_api_key_by_id
UPDATE api_keys SET revoked_at = now()
 WHERE id = %s AND revoked_at IS NULL
RETURNING tenant

-- name: list_api_keys
SELECT id, tenant, created_at, last_used_at, revoked_at FROM api_keys
 WHERE %(tenant)s::text IS NULL OR tenant = %(tenant)s
 ORDER BY created_at

-- name: erase_tenant_api_keys
DELETE FROM api_keys WHERE tenant = %s

-- name: active_api_keys
-- Every active key's hash and tenant: what an API process checks a key
-- against when its address is over the unknown-key budget.
SELECT key_hash, tenant FROM api_keys WHERE revoked_at IS NULL

-- name: tenant_for_key_id
-- The tenant of the active key with this id (a stream token names the key
-- it was given for, by id: it dies with it).
SELECT tenant FROM api_keys WHERE id = %(key_id)s AND revoked_at IS NULL

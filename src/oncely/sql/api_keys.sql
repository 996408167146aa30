-- Statements on the api_keys table, by name. Read with oncely.sql.query("name").

-- name: insert_api_key
INSERT INTO api_keys (key_hash, tenant) VALUES (%s, %s)

-- name: revoke_api_key
UPDATE api_keys SET revoked_at = now()
 WHERE key_hash = %s AND revoked_at IS NULL
RETURNING tenant

-- name: tenant_for_key
SELECT tenant FROM api_keys WHERE key_hash = %s AND revoked_at IS NULL

-- name: erase_tenant_api_keys
DELETE FROM api_keys WHERE tenant = %s

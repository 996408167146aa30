-- API keys get an id an operator can name without the secret (the first 12
-- hex digits of the key's hash: existing keys get theirs too), and the time
-- they were last used (refreshed at most once a minute).
ALTER TABLE api_keys ADD COLUMN id text GENERATED ALWAYS AS (substr(key_hash, 1, 12)) STORED;
CREATE UNIQUE INDEX api_keys_id_key ON api_keys (id);
ALTER TABLE api_keys ADD COLUMN last_used_at timestamptz;

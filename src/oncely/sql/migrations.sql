-- Statements on the oncely_migrations table, by name. Read with oncely.sql.query("name").

-- name: create_migrations_table
CREATE TABLE IF NOT EXISTS oncely_migrations (
    version    integer     CONSTRAINT oncely_migrations_pkey PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)

-- name: add_migration_checksums
-- The SHA-256 of each applied migration's file (NULL: applied before this
-- column existed; `oncely migrate` then records the file as it is).
ALTER TABLE oncely_migrations ADD COLUMN IF NOT EXISTS checksum text

-- name: applied_migrations
SELECT version, checksum FROM oncely_migrations ORDER BY version

-- name: applied_versions
-- A database migrated by a version of oncely that kept no checksums.
SELECT version FROM oncely_migrations ORDER BY version

-- name: record_migration
INSERT INTO oncely_migrations (version, name, checksum) VALUES (%s, %s, %s)

-- name: record_migration_checksum
UPDATE oncely_migrations SET checksum = %s WHERE version = %s AND checksum IS NULL

-- name: migrations_table_exists
SELECT to_regclass('oncely_migrations') IS NOT NULL

-- name: migrations_have_checksums
SELECT EXISTS (
    SELECT 1 FROM information_schema.columns
     WHERE table_name = 'oncely_migrations' AND column_name = 'checksum'
       AND table_schema = current_schema()
)

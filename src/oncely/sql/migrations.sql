-- Statements on the oncely_migrations table, by name. Read with oncely.sql.query("name").

-- name: create_migrations_table
CREATE TABLE IF NOT EXISTS oncely_migrations (
    version    integer     CONSTRAINT oncely_migrations_pkey PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)

-- name: applied_migrations
SELECT version FROM oncely_migrations ORDER BY version

-- name: record_migration
INSERT INTO oncely_migrations (version, name) VALUES (%s, %s)

-- name: migrations_table_exists
SELECT to_regclass('oncely_migrations') IS NOT NULL

-- Room on each outbox page for a row's next version (bench/README.md,
-- Relay). A relay's claim writes only the lease (locked_until, locked_by,
-- attempts), which no index covers; with free space on the row's page
-- PostgreSQL writes that version in place of a new one in every index (a
-- heap-only update). Rows pack their pages full by default, so every claim
-- added an entry to each of the table's four indexes. Pages written from
-- now on keep 30 % free. No rewrite: the lock taken lets reads and writes go on.

ALTER TABLE outbox SET (fillfactor = 70);

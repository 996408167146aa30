"""Live job streams (docs/streaming.md): each job's events in Redis, a view
that PostgreSQL, the record, can always rebuild."""

"""Jobs: the record of acceptance in PostgreSQL, and what moves a job along
(accepting, running a workflow's step, reconciling, replaying)."""

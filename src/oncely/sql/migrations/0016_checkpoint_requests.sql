-- What a checkpoint was asked with, so that a replay can tell a run that
-- asks the same from one that asks something else (docs/durable-steps.md,
-- "Replay never lies"): a call's payload as JSON text, a model turn's
-- request as a digest. `diverged`: a replay asked this model turn with
-- another request and was given the stored answer (counted and shown).
-- Adding nullable columns and a constant default rewrites nothing.
ALTER TABLE checkpoints ADD COLUMN IF NOT EXISTS request text;
ALTER TABLE checkpoints ADD COLUMN IF NOT EXISTS diverged boolean NOT NULL DEFAULT false;

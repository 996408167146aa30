-- Effects no receiver dedupes (docs/at-most-once.md).
--
-- A checkpoint may now also be the intent of an at-most-once call
-- (`intent`: stored before the call runs; found without the call's own
-- checkpoint, the call's outcome is unknown) and the wait for a person's
-- word on such a call (`uncertain`). The constraint is added NOT VALID then
-- validated, so the scan of existing rows does not hold the table's
-- exclusive lock.
ALTER TABLE checkpoints DROP CONSTRAINT checkpoints_kind_check;
ALTER TABLE checkpoints ADD CONSTRAINT checkpoints_kind_check
    CHECK (kind IN ('step', 'model', 'wait', 'sleep', 'tool', 'call', 'approval', 'patch', 'map',
                    'intent', 'uncertain', 'reconcile'))
    NOT VALID;
ALTER TABLE checkpoints VALIDATE CONSTRAINT checkpoints_kind_check;

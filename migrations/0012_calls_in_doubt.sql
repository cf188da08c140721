-- The calls in doubt are those with a next probe set (src/ledger/external.rs):
-- every unknown outcome sets it, before a call is called indeterminate,
-- and a verdict now clears it. Two kinds of row do not fit yet, and this
-- fits them, in a transaction of its own that blocks no phase (it only
-- updates rows, and few of them):
-- - calls called indeterminate before the probe's back-off existed
--   (migration 0006), which have no next probe; all of them were made
--   before partitioning (migration 0010), so they are in the history;
-- - calls settled after being parked, which kept theirs.
DO $$
BEGIN
    IF to_regclass('external_calls_history') IS NOT NULL THEN
        UPDATE external_calls_history SET next_probe_at = last_attempt_at
         WHERE outcome = 'indeterminate' AND next_probe_at IS NULL;
    END IF;
END $$;
UPDATE external_calls SET next_probe_at = NULL
 WHERE outcome IN ('done', 'declined') AND next_probe_at IS NOT NULL;

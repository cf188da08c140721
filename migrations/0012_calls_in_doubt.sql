-- The calls in doubt are those with a next probe set (src/ledger/external.rs):
-- every unknown outcome sets it, before a call is called indeterminate,
-- and a verdict now clears it. This fits the rows from before: calls
-- called indeterminate before the probe's back-off existed (migration
-- 0006) get one, and calls settled after being parked lose theirs. It
-- reads every call once, in a transaction of its own; it holds up only a
-- verdict for one of the few calls it changes.
UPDATE external_calls SET next_probe_at = CASE WHEN outcome = 'indeterminate' THEN last_attempt_at END
 WHERE (outcome = 'indeterminate' AND next_probe_at IS NULL)
    OR (outcome IN ('done', 'declined') AND next_probe_at IS NOT NULL);

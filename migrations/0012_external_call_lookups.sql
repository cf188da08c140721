-- Two lookups of external calls that read every partition, whole, while
-- the table holds the retention's worth of calls: a rail's notification
-- names its instruction by derived key (src/ledger/inbox.rs), and each
-- recovery sweep lists the calls whose outcome stayed in doubt
-- (src/ledger/external.rs). Neither index names a column a verdict sets
-- (outcome, result, fence, done_at), so recording a verdict stays a
-- heap-only update where the page has room.
--
-- Building an index locks each partition against writes while it is
-- built. On a ledger that already holds many calls, build each
-- partition's index first with CREATE INDEX CONCURRENTLY, on the same
-- column (and, for the second, the same predicate): these statements then
-- only attach them (docs/deploy.md).
CREATE INDEX external_calls_by_derived_key ON external_calls (derived_key);

-- A call in doubt has been probed and parked: its next probe is set by
-- every unknown outcome, which comes before it is called indeterminate.
-- Calls parked before the back-off existed have none yet.
UPDATE external_calls SET next_probe_at = last_attempt_at
 WHERE outcome IN ('unknown', 'indeterminate') AND next_probe_at IS NULL;
CREATE INDEX external_calls_in_doubt ON external_calls (last_attempt_at) WHERE next_probe_at IS NOT NULL;

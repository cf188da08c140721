-- Two lookups of external calls that read every partition, whole, while
-- the table holds the retention's worth of calls: a rail's notification
-- names its instruction by derived key (src/ledger/inbox.rs), and each
-- recovery sweep lists the calls whose outcome is in doubt
-- (src/ledger/external.rs), those with a next probe set (migration 0012).
-- A verdict's update sets no column these name (it clears the next probe
-- of a call parked before, which had one), so recording the verdict of a
-- call never parked stays a heap-only update where the page has room; an
-- unknown outcome (a rare park) now updates the indexes too.
--
-- Creating an index on the partitioned table blocks writes to every
-- partition until this migration commits, and builds what is missing. On
-- a ledger that already holds many calls, build each partition's index
-- first, without blocking, as docs/deploy.md shows: these statements then
-- find them and only attach them.
CREATE INDEX external_calls_by_derived_key ON external_calls (derived_key);
CREATE INDEX external_calls_in_doubt ON external_calls (last_attempt_at) WHERE next_probe_at IS NOT NULL;

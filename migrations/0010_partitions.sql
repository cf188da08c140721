-- The idempotency tables grow with every request: `requests`, `phase_runs`
-- and `external_calls` become partitioned by time on the request's
-- created_at, which every row already carries in its key. Partitions are
-- created ahead and dropped once every request in them has ended and its
-- key has expired (src/ledger/partitions.rs); payments, refunds and
-- postings are business records and stay.
--
-- Each table gets three kinds of partition, all sharing one name suffix
-- across the three tables (a request, its phase runs and its calls always
-- fall in partitions of the same suffix):
--   _history  the rows written before this migration (see its bound below);
--   _p<start> one span of time each (a day by default), made ahead;
--   _default  rows no span partition takes: a request adopted from another
--             region long after it began, or rows written while no
--             partition was made ahead. Its ended rows are deleted, not
--             dropped.

-- Business records outlive the requests that made them.
ALTER TABLE payments DROP CONSTRAINT payments_client_id_idem_key_request_created_at_fkey;
ALTER TABLE refunds DROP CONSTRAINT refunds_client_id_idem_key_request_created_at_fkey;
-- Put back below, on the partitioned tables.
ALTER TABLE phase_runs DROP CONSTRAINT phase_runs_client_id_idem_key_request_created_at_fkey;
ALTER TABLE external_calls DROP CONSTRAINT external_calls_client_id_idem_key_request_created_at_fkey;

ALTER TABLE requests RENAME TO requests_history;
ALTER TABLE requests_history RENAME CONSTRAINT requests_pkey TO requests_history_pkey;
ALTER INDEX requests_unfinished RENAME TO requests_history_unfinished;
ALTER INDEX requests_by_created_at RENAME TO requests_history_by_created_at;
CREATE TABLE requests (
    LIKE requests_history INCLUDING DEFAULTS INCLUDING CONSTRAINTS,
    PRIMARY KEY (client_id, idem_key, created_at)
) PARTITION BY RANGE (created_at);
CREATE INDEX requests_unfinished ON requests (updated_at) WHERE recovery_point <> 'FINISHED';
CREATE INDEX requests_by_created_at ON requests (created_at);
-- What makes the check before a drop cheap: whether anything in the
-- partition moved since its key could still be live.
CREATE INDEX requests_by_updated_at ON requests (updated_at);

ALTER TABLE phase_runs RENAME TO phase_runs_history;
ALTER TABLE phase_runs_history RENAME CONSTRAINT phase_runs_pkey TO phase_runs_history_pkey;
CREATE TABLE phase_runs (
    LIKE phase_runs_history INCLUDING DEFAULTS INCLUDING CONSTRAINTS,
    PRIMARY KEY (client_id, idem_key, request_created_at, point)
) PARTITION BY RANGE (request_created_at);

ALTER TABLE external_calls RENAME TO external_calls_history;
ALTER TABLE external_calls_history RENAME CONSTRAINT external_calls_pkey TO external_calls_history_pkey;
CREATE TABLE external_calls (
    LIKE external_calls_history INCLUDING DEFAULTS INCLUDING CONSTRAINTS,
    PRIMARY KEY (client_id, idem_key, request_created_at, step)
) PARTITION BY RANGE (request_created_at);

-- The history ends now on a new ledger. On one that already holds
-- requests it ends at the second midnight (UTC) from now: instances of the
-- previous version, still serving while a deployment rolls out, keep
-- writing requests of today, and those land in the history rather than in
-- the default partition. The span partitions begin where it ends.
DO $$
DECLARE
    until timestamptz := CASE
        WHEN EXISTS (SELECT 1 FROM requests_history)
        THEN greatest(date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' + interval '2 days',
                      (SELECT max(created_at) + interval '1 microsecond' FROM requests_history))
        ELSE now() END;
BEGIN
    EXECUTE format('ALTER TABLE requests ATTACH PARTITION requests_history FOR VALUES FROM (MINVALUE) TO (%L)', until);
    EXECUTE format('ALTER TABLE phase_runs ATTACH PARTITION phase_runs_history FOR VALUES FROM (MINVALUE) TO (%L)', until);
    EXECUTE format('ALTER TABLE external_calls ATTACH PARTITION external_calls_history FOR VALUES FROM (MINVALUE) TO (%L)', until);
END $$;

CREATE TABLE requests_default PARTITION OF requests DEFAULT;
CREATE TABLE phase_runs_default PARTITION OF phase_runs DEFAULT;
CREATE TABLE external_calls_default PARTITION OF external_calls DEFAULT;

-- A phase run and an external call name their request, partition to
-- partition: the three tables share their bounds, so a row's request lies
-- in the partition of the same suffix. (A key on the partitioned tables
-- would make detaching a span of requests check every partition of the
-- other two, under the lock every phase waits for.) Each span made later
-- gets the same two keys (src/ledger/partitions.rs).
ALTER TABLE phase_runs_history ADD FOREIGN KEY (client_id, idem_key, request_created_at) REFERENCES requests_history;
ALTER TABLE external_calls_history ADD FOREIGN KEY (client_id, idem_key, request_created_at) REFERENCES requests_history;
ALTER TABLE phase_runs_default ADD FOREIGN KEY (client_id, idem_key, request_created_at) REFERENCES requests_default;
ALTER TABLE external_calls_default ADD FOREIGN KEY (client_id, idem_key, request_created_at) REFERENCES requests_default;

-- The inbox keeps what it applied or found nothing to do for as long as
-- the requests it named; this finds those rows by age.
CREATE INDEX inbox_ended ON inbox (received_at) WHERE state IN ('applied', 'ignored');

-- The idempotency tables are partitioned by day, on the created_at every
-- request's key already carries (a request, its phase runs and its external
-- calls share it, so all three of a request's rows lie in one day's
-- partitions). `keyfence maintain --partitions`, and `serve` on a schedule,
-- adds days ahead and drops whole days once every request in them is
-- finished and its key past its retention (src/ledger/partitions.rs), so
-- these tables hold what the retention allows and no more. Payments,
-- refunds and postings are business records: kept, never dropped, so they
-- no longer reference `requests`.
--
-- A row whose day has no partition (a request far older than the oldest
-- day kept, adopted after a failover) lands in the table's DEFAULT
-- partition rather than failing its phase; maintenance reports it.

-- Every foreign key that points at `requests`: the business records'
-- (dropped for good) and the phase runs' and external calls' (made again
-- below, between the partitioned tables).
DO $$
DECLARE
    fk record;
BEGIN
    FOR fk IN SELECT conrelid::regclass AS tab, conname FROM pg_constraint
               WHERE contype = 'f' AND confrelid = 'requests'::regclass
    LOOP
        EXECUTE format('ALTER TABLE %s DROP CONSTRAINT %I', fk.tab, fk.conname);
    END LOOP;
END $$;

ALTER TABLE requests RENAME TO requests_before;
ALTER TABLE phase_runs RENAME TO phase_runs_before;
ALTER TABLE external_calls RENAME TO external_calls_before;

CREATE TABLE requests (LIKE requests_before INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
    PARTITION BY RANGE (created_at);
CREATE TABLE phase_runs (LIKE phase_runs_before INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
    PARTITION BY RANGE (request_created_at);
CREATE TABLE external_calls (LIKE external_calls_before INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
    PARTITION BY RANGE (request_created_at);

CREATE TABLE requests_default PARTITION OF requests DEFAULT;
CREATE TABLE phase_runs_default PARTITION OF phase_runs DEFAULT;
CREATE TABLE external_calls_default PARTITION OF external_calls DEFAULT;

-- The partitioned tables, parents first, and the column that splits each.
CREATE FUNCTION keyfence_partitioned_tables() RETURNS TABLE (name text, by_column text)
LANGUAGE sql IMMUTABLE AS $$
    VALUES ('requests', 'created_at'), ('phase_runs', 'request_created_at'), ('external_calls', 'request_created_at')
$$;

-- Adds the partitions of every UTC day from `first` to `last` that has none
-- yet; returns how many tables it made. Each is made apart and then
-- attached, which locks the parent only against other schema changes, not
-- against reads and writes. A day that already has rows in the default
-- partition (no maintenance ran for that long) is left there: attaching
-- would fail, and the rows are kept either way.
CREATE FUNCTION keyfence_add_day_partitions(first date, last date) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    day date := first;
    made integer := 0;
    t record;
    part text;
BEGIN
    WHILE day <= last LOOP
        FOR t IN SELECT * FROM keyfence_partitioned_tables() LOOP
            part := t.name || '_' || to_char(day, 'YYYYMMDD');
            IF to_regclass(part) IS NULL AND NOT EXISTS (
                SELECT 1 FROM requests_default
                 WHERE created_at >= day::timestamp AT TIME ZONE 'UTC'
                   AND created_at < (day + 1)::timestamp AT TIME ZONE 'UTC') THEN
                EXECUTE format('CREATE TABLE %I (LIKE %I INCLUDING DEFAULTS INCLUDING CONSTRAINTS)', part, t.name);
                EXECUTE format('ALTER TABLE %I ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)', t.name, part,
                               day::timestamp AT TIME ZONE 'UTC', (day + 1)::timestamp AT TIME ZONE 'UTC');
                made := made + 1;
            END IF;
        END LOOP;
        day := day + 1;
    END LOOP;
    RETURN made;
END $$;

-- Drops UTC day `day`'s partitions if every request in them is finished or
-- given up and was last written before `settled_before` (so its key is past
-- its retention everywhere). Says whether it dropped them, how many requests
-- of the day are unfinished, and when the day was last written. It decides
-- twice: once without locks (a day that must stay costs nothing more), then
-- again with the three tables locked, so no request can slip in between the
-- check and the drop; the locks last as long as the index lookups and the
-- drop, and are taken in the order every phase takes them (parents first).
CREATE FUNCTION keyfence_drop_day_partitions(day date, settled_before timestamptz,
                                             OUT dropped boolean, OUT unfinished bigint, OUT last_written timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    suffix text := to_char(day, 'YYYYMMDD');
    locked boolean := false;
BEGIN
    dropped := false;
    unfinished := 0;
    IF to_regclass('requests_' || suffix) IS NULL THEN
        RETURN;
    END IF;
    LOOP
        EXECUTE format('SELECT count(*) FROM %I WHERE recovery_point NOT IN (%L, %L)',
                       'requests_' || suffix, 'FINISHED', 'VOIDED') INTO unfinished;
        EXECUTE format('SELECT max(updated_at) FROM %I', 'requests_' || suffix) INTO last_written;
        IF unfinished > 0 OR last_written >= settled_before THEN
            RETURN;
        END IF;
        EXIT WHEN locked;
        LOCK TABLE requests, phase_runs, external_calls IN ACCESS EXCLUSIVE MODE;
        locked := true;
    END LOOP;
    -- The rows that reference a request first: a detached partition keeps
    -- its foreign key, so it goes before the requests it points at.
    EXECUTE format('ALTER TABLE phase_runs DETACH PARTITION %I', 'phase_runs_' || suffix);
    EXECUTE format('DROP TABLE %I', 'phase_runs_' || suffix);
    EXECUTE format('ALTER TABLE external_calls DETACH PARTITION %I', 'external_calls_' || suffix);
    EXECUTE format('DROP TABLE %I', 'external_calls_' || suffix);
    EXECUTE format('ALTER TABLE requests DETACH PARTITION %I', 'requests_' || suffix);
    EXECUTE format('DROP TABLE %I', 'requests_' || suffix);
    dropped := true;
END $$;

-- Every day the existing rows need, and three days ahead.
SELECT keyfence_add_day_partitions(
    least(coalesce((SELECT min(created_at AT TIME ZONE 'UTC')::date FROM requests_before), current_date),
          (now() AT TIME ZONE 'UTC')::date),
    (now() AT TIME ZONE 'UTC')::date + 3);

INSERT INTO requests SELECT * FROM requests_before;
INSERT INTO phase_runs SELECT * FROM phase_runs_before;
INSERT INTO external_calls SELECT * FROM external_calls_before;
DROP TABLE phase_runs_before, external_calls_before, requests_before;

ALTER TABLE requests ADD PRIMARY KEY (client_id, idem_key, created_at);
CREATE INDEX requests_unfinished ON requests (updated_at) WHERE recovery_point <> 'FINISHED';
CREATE INDEX requests_by_created_at ON requests (created_at);
-- When each day was last written, for maintenance (one index lookup a day).
CREATE INDEX requests_by_updated_at ON requests (updated_at);
ALTER TABLE phase_runs ADD PRIMARY KEY (client_id, idem_key, request_created_at, point);
ALTER TABLE phase_runs ADD FOREIGN KEY (client_id, idem_key, request_created_at) REFERENCES requests;
ALTER TABLE external_calls ADD PRIMARY KEY (client_id, idem_key, request_created_at, step);
ALTER TABLE external_calls ADD FOREIGN KEY (client_id, idem_key, request_created_at) REFERENCES requests;

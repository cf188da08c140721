-- A region declared failed can be fenced in its own ledger as well, when an
-- SRE can still reach it (`keyfence regions fail --ledger ...`). Every phase
-- reads this row, under a share lock, in its own transaction: while it says
-- failed, nothing commits. Setting it waits for the phases in flight, so
-- once the SRE's command returns, no phase of the old region can commit.
CREATE TABLE region_fence (
    only_row   boolean     PRIMARY KEY DEFAULT true CHECK (only_row),
    failed     boolean     NOT NULL DEFAULT false,
    region     text,
    epoch      bigint      NOT NULL DEFAULT 0,
    reason     text,
    changed_at timestamptz NOT NULL DEFAULT now()
);

INSERT INTO region_fence DEFAULT VALUES;

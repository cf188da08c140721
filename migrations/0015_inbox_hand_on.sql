SET LOCAL lock_timeout = '10s';

-- A rail notifies one URL, not one per region: a notification about
-- another region's instruction (or about a request that moved to another
-- region) is handed on to the region holding its live copy. Until one
-- takes it, it waits here `forwarding`, with the rail's own bytes and
-- signature so that the region it is handed to checks the rail's word
-- itself; once taken it is `forwarded` (its note names the region) and
-- pruned like any message that took effect. A message no region takes is
-- kept for a person (`unknown`), as before.
ALTER TABLE inbox
    ADD COLUMN raw bytea,
    ADD COLUMN signed_at bigint,
    ADD COLUMN signature text,
    -- Whether this region received it from another (never handed on again).
    ADD COLUMN handed_from text,
    ADD COLUMN forwarding_since timestamptz,
    ADD COLUMN hand_after timestamptz,
    -- Set while, at the last offer, some region could not be asked
    -- (unreachable, declared failed, an answer not to be believed).
    ADD COLUMN unanswered_at timestamptz;

ALTER TABLE inbox DROP CONSTRAINT inbox_state_check;
ALTER TABLE inbox ADD CONSTRAINT inbox_state_check
    CHECK (state IN ('pending', 'applied', 'ignored', 'unknown', 'settled', 'forwarding', 'forwarded'));

CREATE INDEX inbox_forwarding ON inbox (hand_after) WHERE state = 'forwarding';
DROP INDEX inbox_ended;
CREATE INDEX inbox_ended ON inbox (received_at) WHERE state IN ('applied', 'ignored', 'forwarded');

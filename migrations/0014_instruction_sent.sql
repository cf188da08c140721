-- Taking locks on every partition of a busy table waits behind open
-- phases, and new phases wait behind it: give up soon, and migrate again.
SET LOCAL lock_timeout = '10s';

-- What each external call's instruction carried that a rail's notification
-- is matched against: its end-to-end reference, amount and currency,
-- written with the intent by every operation (payments, refunds, and
-- operations outside the crate alike). A notification about a refund was
-- matched against a payment row before, which a refund's request has none
-- of, so every verdict or return of a refund was kept as unmatched. Calls
-- recorded before this migration carry none and are matched as before,
-- against their payment. Adding a column without a default rewrites
-- nothing.
ALTER TABLE external_calls ADD COLUMN sent jsonb;

-- A message kept for a person (state `unknown`) ends when a person has
-- settled it with the rail (`keyfence inbox settle`): `settled`, with what
-- they said, kept like the rest of the person's record.
ALTER TABLE inbox DROP CONSTRAINT inbox_state_check;
ALTER TABLE inbox ADD CONSTRAINT inbox_state_check
    CHECK (state IN ('pending', 'applied', 'ignored', 'unknown', 'settled'));

-- What each external call's instruction carried that a rail's notification
-- is matched against: its end-to-end reference, amount and currency,
-- written with the intent by every operation (payments, refunds, and
-- operations outside the crate alike). A notification about a refund was
-- matched against a payment row before, which a refund's request has none
-- of, so every verdict or return of a refund was kept as unmatched. Calls
-- recorded before this migration carry none and are matched as before,
-- against their payment. Adding a column without a default rewrites
-- nothing and blocks writes only for the moment it takes.
ALTER TABLE external_calls ADD COLUMN sent jsonb;

-- What the reconciler needs from the ledger.

-- The canonical request, so a key lost from the key store can be recreated
-- exactly (with its fingerprint) from the ledger alone.
ALTER TABLE requests ADD COLUMN request bytea NOT NULL DEFAULT ''::bytea;

-- Requests by time, for the reconciler's window.
CREATE INDEX requests_by_created_at ON requests (created_at);

-- Refunds: a second operation through the same engine. A refund is a
-- request of its own (its key, its phases, its recovery points), worked in
-- the region that claimed it, whichever region worked the payment: its row
-- names the payment by id, and carries what it needs of it (the accounts
-- the money goes back between), since the payment may live in another
-- region's ledger. What is left to refund is decided by the payment's
-- balance item in the key table, the one arbiter every region shares.
CREATE TABLE refunds (
    id                 uuid        PRIMARY KEY,
    client_id          uuid        NOT NULL,
    idem_key           text        NOT NULL,
    request_created_at timestamptz NOT NULL,
    payment_id         uuid        NOT NULL,
    amount_minor       bigint      NOT NULL CHECK (amount_minor > 0),
    currency           char(3)     NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    -- The payment's accounts: the refund moves money from its creditor
    -- back to its debtor.
    debtor_account     text        NOT NULL,
    creditor_account   text        NOT NULL,
    reason             text,
    status             text        NOT NULL,
    rail_reference     text,
    -- Why the rail declined it (a reason code).
    decline_reason     text,
    fence              bigint      NOT NULL,
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now(),
    FOREIGN KEY (client_id, idem_key, request_created_at) REFERENCES requests
);

CREATE INDEX refunds_by_payment ON refunds (client_id, payment_id, created_at);

-- Postings and events now belong to a payment or to a refund: the column
-- keeps its name (`payment_id`) and names either, so a refund worked in a
-- region that does not hold its payment still balances on its own.
ALTER TABLE postings DROP CONSTRAINT postings_payment_id_fkey;
ALTER TABLE outbox DROP CONSTRAINT outbox_payment_id_fkey;

-- What a request's postings and events belong to: its payment or its refund.
CREATE VIEW ledger_subjects AS
    SELECT id, client_id, idem_key, request_created_at, status FROM payments
    UNION ALL
    SELECT id, client_id, idem_key, request_created_at, status FROM refunds;

-- The regional ledger. Every phase of a request is one transaction here that
-- does its business writes, advances the request's recovery point and checks
-- the request's fencing token (see src/ledger/phase.rs).
--
-- The key store arbitrates which attempt owns a key; this database records
-- what that owner did. Tables that will be partitioned by day carry
-- created_at in their primary key, because PostgreSQL requires the partition
-- column in every unique constraint of a partitioned table.

CREATE TABLE requests (
    client_id      uuid        NOT NULL,
    idem_key       text        NOT NULL,
    -- The key item's created_at, passed by every phase so queries can prune
    -- to one partition.
    created_at     timestamptz NOT NULL,
    operation      text        NOT NULL,
    request_hash   text        NOT NULL,
    payment_id     uuid        NOT NULL,
    -- The newest fencing token that wrote this request; a phase carrying an
    -- older one finds zero rows to update and rolls back.
    fence          bigint      NOT NULL CHECK (fence > 0),
    recovery_point text        NOT NULL,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (client_id, idem_key, created_at)
);

-- Unfinished requests, for the recovery worker and the reconciler.
CREATE INDEX requests_unfinished ON requests (updated_at) WHERE recovery_point <> 'FINISHED';

CREATE TABLE payments (
    id                 uuid        PRIMARY KEY,
    client_id          uuid        NOT NULL,
    idem_key           text        NOT NULL,
    request_created_at timestamptz NOT NULL,
    amount_minor       bigint      NOT NULL CHECK (amount_minor > 0),
    currency           char(3)     NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    debtor_account     text        NOT NULL,
    creditor_account   text        NOT NULL,
    end_to_end_id      varchar(35) NOT NULL,
    remittance_info    text,
    status             text        NOT NULL,
    fence              bigint      NOT NULL,
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now(),
    FOREIGN KEY (client_id, idem_key, request_created_at) REFERENCES requests
);

CREATE INDEX payments_by_reference ON payments (client_id, end_to_end_id);

-- Double entry: append-only, and every payment's postings sum to zero in
-- each currency when a transaction commits.
CREATE TABLE postings (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    payment_id   uuid        NOT NULL REFERENCES payments,
    entry        text        NOT NULL,
    account      text        NOT NULL,
    amount_minor bigint      NOT NULL CHECK (amount_minor <> 0),
    currency     char(3)     NOT NULL,
    fence        bigint      NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX postings_by_payment ON postings (payment_id);

CREATE FUNCTION postings_must_balance() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    off text;
BEGIN
    SELECT currency INTO off FROM postings
     WHERE payment_id = NEW.payment_id
     GROUP BY currency HAVING sum(amount_minor) <> 0
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'postings of payment % do not balance in %', NEW.payment_id, off
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NULL;
END $$;

CREATE CONSTRAINT TRIGGER postings_balanced
    AFTER INSERT ON postings DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION postings_must_balance();

CREATE FUNCTION postings_are_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'postings are never changed or deleted; post a compensating entry'
        USING ERRCODE = 'restrict_violation';
END $$;

CREATE TRIGGER postings_append_only
    BEFORE UPDATE OR DELETE ON postings
    FOR EACH ROW EXECUTE FUNCTION postings_are_append_only();

-- Calls to external systems: intent committed before the call (outcome
-- 'sent'), outcome committed after it. The derived key is what the external
-- system deduplicates on, so a resumed call is a replay, not a new instruction.
CREATE TABLE external_calls (
    client_id          uuid        NOT NULL,
    idem_key           text        NOT NULL,
    request_created_at timestamptz NOT NULL,
    step               text        NOT NULL,
    derived_key        uuid        NOT NULL,
    fence              bigint      NOT NULL,
    outcome            text        NOT NULL CHECK (outcome IN ('sent', 'done', 'unknown', 'indeterminate')),
    attempts           integer     NOT NULL DEFAULT 1,
    result             jsonb,
    sent_at            timestamptz NOT NULL DEFAULT now(),
    done_at            timestamptz,
    PRIMARY KEY (client_id, idem_key, request_created_at, step),
    FOREIGN KEY (client_id, idem_key, request_created_at) REFERENCES requests
);

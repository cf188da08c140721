-- The front door: API clients, the final answer of each request, a record of
-- every phase that ran, and the outbox for webhooks.

-- API clients. Only a SHA-256 of each API key is kept: keys are 256-bit
-- random strings, so a fast hash is enough and a leaked table reveals none.
CREATE TABLE clients (
    id           uuid        PRIMARY KEY,
    name         text        NOT NULL,
    api_key_hash text        NOT NULL UNIQUE,
    created_at   timestamptz NOT NULL DEFAULT now()
);

-- The final answer, written by the last phase in the same transaction that
-- reaches FINISHED, then copied to the key store. The reconciler compares
-- the two.
ALTER TABLE requests
    ADD COLUMN response_status  integer,
    ADD COLUMN response_headers jsonb,
    ADD COLUMN response_body    bytea;

-- One row per recovery point a request reached. The primary key makes a
-- second run of any phase fail its transaction: a phase runs at most once.
CREATE TABLE phase_runs (
    client_id          uuid        NOT NULL,
    idem_key           text        NOT NULL,
    request_created_at timestamptz NOT NULL,
    point              text        NOT NULL,
    fence              bigint      NOT NULL,
    ran_at             timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (client_id, idem_key, request_created_at, point),
    FOREIGN KEY (client_id, idem_key, request_created_at) REFERENCES requests
);

-- Events for webhooks, written in the phase that causes them and delivered
-- after commit, each with its own idempotency key downstream.
CREATE TABLE outbox (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    payment_id   uuid        NOT NULL REFERENCES payments,
    event        text        NOT NULL,
    payload      jsonb       NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    delivered_at timestamptz,
    UNIQUE (payment_id, event)
);

CREATE INDEX outbox_undelivered ON outbox (id) WHERE delivered_at IS NULL;

-- External calls gain the time of their last attempt, for the recovery worker.
ALTER TABLE external_calls ADD COLUMN last_attempt_at timestamptz NOT NULL DEFAULT now();

-- The rail's own reference for a settled payment.
ALTER TABLE payments ADD COLUMN rail_reference text;

-- Webhook delivery. A phase writes its event into `outbox` (inside the
-- phase's transaction); after commit the delivery worker fans each event
-- out to the client's endpoints subscribed to it, one row per event and
-- endpoint in `webhook_deliveries`, and works those rows until each is
-- delivered or has used up its retry schedule (src/webhooks/).

-- The event's own id (stable: derived from the payment and the event type,
-- so the same event written by two ledgers after a takeover is one event),
-- and whose it is. Rows written before this migration get an id of their
-- own.
ALTER TABLE outbox ADD COLUMN event_id uuid;
ALTER TABLE outbox ADD COLUMN client_id uuid;
UPDATE outbox o SET client_id = p.client_id FROM payments p WHERE p.id = o.payment_id;
UPDATE outbox SET event_id = gen_random_uuid();
ALTER TABLE outbox ALTER COLUMN event_id SET NOT NULL;
ALTER TABLE outbox ALTER COLUMN client_id SET NOT NULL;
ALTER TABLE outbox ADD UNIQUE (event_id);

-- Instances of the previous version, still serving while a deployment
-- rolls out, queue events without these columns: they are filled in here
-- rather than failing those instances' phases.
CREATE FUNCTION outbox_fill_in() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.client_id := coalesce(NEW.client_id, (SELECT client_id FROM payments WHERE id = NEW.payment_id));
    NEW.event_id := coalesce(NEW.event_id, gen_random_uuid());
    RETURN NEW;
END $$;

CREATE TRIGGER outbox_filled_in BEFORE INSERT ON outbox
    FOR EACH ROW WHEN (NEW.event_id IS NULL OR NEW.client_id IS NULL) EXECUTE FUNCTION outbox_fill_in();

-- When the event was fanned out to its endpoints (those registered before
-- it was written). Events already queued are fanned out like new ones.
ALTER TABLE outbox ADD COLUMN fanned_out_at timestamptz;
DROP INDEX outbox_undelivered;
ALTER TABLE outbox DROP COLUMN delivered_at;
CREATE INDEX outbox_to_fan_out ON outbox (id) WHERE fanned_out_at IS NULL;
CREATE INDEX outbox_by_created_at ON outbox (created_at);

-- Payloads carry masked account numbers (the full payment is one
-- authenticated GET away): the rows written before this are masked too.
UPDATE outbox SET payload = jsonb_build_object(
    'id', payload->'payment'->'id',
    'status', payload->'payment'->'status',
    'amount_minor', payload->'payment'->'amount_minor',
    'currency', payload->'payment'->'currency',
    'debtor_account', '****' || right(payload->'payment'->>'debtor_account', 4),
    'creditor_account', '****' || right(payload->'payment'->>'creditor_account', 4),
    'end_to_end_id', payload->'payment'->'end_to_end_id')
 WHERE payload ? 'payment';

CREATE TABLE webhook_deliveries (
    event_id        uuid        NOT NULL REFERENCES outbox (event_id) ON DELETE CASCADE,
    endpoint_id     uuid        NOT NULL,
    -- The `webhook-id` header: the receiver's idempotency key, the same on
    -- every attempt and redelivery.
    webhook_id      text        NOT NULL,
    state           text        NOT NULL DEFAULT 'pending'
                                CHECK (state IN ('pending', 'delivered', 'failed')),
    attempts        integer     NOT NULL DEFAULT 0,
    -- When the next attempt is due. A worker that takes the delivery moves
    -- it past its lease, so no other worker takes it while it is sent.
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    -- Raised by every take; a result is recorded only under the lease it
    -- was taken with, so a worker whose lease ran out is refused.
    lease           bigint      NOT NULL DEFAULT 0,
    last_status     integer,
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz,
    PRIMARY KEY (event_id, endpoint_id)
);

CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at) WHERE state = 'pending';
CREATE INDEX webhook_deliveries_by_endpoint ON webhook_deliveries (endpoint_id) WHERE state = 'pending';
CREATE INDEX webhook_deliveries_failed ON webhook_deliveries (created_at) WHERE state = 'failed';

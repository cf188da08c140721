-- The inbox: messages the rails send after the fact (a verdict whose answer
-- was lost, a return days later), each kept once by its message id. A
-- message is recorded when it arrives and applied in the phase that takes
-- its effect (src/inbox/): a verdict in the phase that records the
-- external call's outcome, a return in the phase that posts it.
CREATE TABLE inbox (
    rail        text        NOT NULL,
    message_id  text        NOT NULL,
    kind        text        NOT NULL CHECK (kind IN ('applied', 'declined', 'returned')),
    -- The instruction's key as the rail names it (a derived key), if it is one.
    derived_key uuid,
    body        jsonb       NOT NULL,
    -- pending: waits for its effect; applied: took effect; ignored: nothing
    -- left to do (the outcome was known already); unknown: names no
    -- instruction of this ledger, kept for the reconciler.
    state       text        NOT NULL CHECK (state IN ('pending', 'applied', 'ignored', 'unknown')),
    note        text,
    received_at timestamptz NOT NULL DEFAULT now(),
    applied_at  timestamptz,
    PRIMARY KEY (rail, message_id)
);

CREATE INDEX inbox_pending ON inbox (derived_key) WHERE state = 'pending';
CREATE INDEX inbox_unknown ON inbox (received_at) WHERE state = 'unknown';

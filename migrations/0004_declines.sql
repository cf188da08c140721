-- Declines: a screening system or a rail can refuse an instruction for good.
-- The refusal is recorded on the call (outcome 'declined', result holding the
-- reason) and ends the payment as 'rejected', with the reason kept on it.

ALTER TABLE external_calls DROP CONSTRAINT external_calls_outcome_check;
ALTER TABLE external_calls ADD CONSTRAINT external_calls_outcome_check
    CHECK (outcome IN ('sent', 'done', 'declined', 'unknown', 'indeterminate'));

ALTER TABLE payments ADD COLUMN reason text;

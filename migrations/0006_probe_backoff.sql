-- When the recovery worker may probe a parked external call again: each
-- unknown outcome pushes it further out (exponential back-off), so parked
-- requests do not take every sweep. NULL: never parked.
ALTER TABLE external_calls ADD COLUMN next_probe_at timestamptz;

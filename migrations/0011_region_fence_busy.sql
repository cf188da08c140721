-- A phase opens by trying the region fence's lock without waiting
-- (src/ledger/region_fence.rs). When a change of the fence holds the lock
-- or waits for it, the try fails and this raises, before the phase's
-- transaction begins: the phase then opens again the slow way, waiting
-- behind the change with no timeout of the server's cutting the wait short.
CREATE FUNCTION region_fence_busy() RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'a change of the region fence holds or awaits its lock'
        USING ERRCODE = 'KF001';
END $$;

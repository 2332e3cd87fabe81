-- The leader's lease: the Postgres backend holding the leadership lock and until when (the
-- database's clock, in ms) its claim lasts without renewal. A standby that finds the lease
-- lapsed terminates that backend, which releases the lock: a hung or cut-off leader no longer
-- blocks failover until Postgres notices its session is dead.
ALTER TABLE leadership ADD COLUMN backend_pid BIGINT;
ALTER TABLE leadership ADD COLUMN lease_expires_at_ms BIGINT;

ALTER TABLE leadership DROP COLUMN lease_expires_at_ms;
ALTER TABLE leadership DROP COLUMN backend_pid;

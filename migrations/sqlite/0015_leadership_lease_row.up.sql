-- The leader's lease on a row of its own. Every write of round state reads the leadership
-- row's epoch FOR SHARE (the fence), and renewing the lease on that same row had to wait for
-- every write in flight: under a thousand devices' uploads a renewal queued 1-4 s and the lone
-- leader deposed itself mid-round. No write locks this row. `epoch` is the leader's at its
-- acquisition; `backend_pid` the Postgres backend holding the leadership lock.
CREATE TABLE leadership_lease (
    id BIGINT PRIMARY KEY,
    epoch BIGINT NOT NULL,
    backend_pid BIGINT,
    lease_expires_at_ms BIGINT
);
INSERT INTO leadership_lease (id, epoch, backend_pid, lease_expires_at_ms)
    SELECT id, epoch, backend_pid, lease_expires_at_ms FROM leadership WHERE id = 1;

-- Fleet requests a replica (a coordinator that does not lead) relays to the leader through the
-- store: the replica writes the request, the leader takes it (`taken_at_ms`), hands it to its
-- driver and writes the answer; the replica reads the answer back (deleting the row) and
-- answers the device. `replica` names the process that waits for the answer. `request` is the
-- CBOR of the relayed request (an update's delta included), emptied once answered.
-- UNLOGGED: nothing here is state. A request or answer lost with a crash of Postgres itself is
-- a request nobody answered, which its replica answers 503 (or "come back") and the device
-- retries; an acknowledgement is only ever given after the leader's own durable write. So these
-- rows skip the WAL (a relayed update's bytes are not written to it twice) and fsync.
CREATE UNLOGGED TABLE relayed_requests (
    id BIGSERIAL PRIMARY KEY,
    replica BIGINT NOT NULL,
    request BYTEA NOT NULL,
    created_at_ms BIGINT NOT NULL,
    taken_at_ms BIGINT,
    answer BYTEA,
    answered_at_ms BIGINT
);
-- What the leader polls: requests nobody took yet, in arrival order.
CREATE INDEX relayed_requests_waiting ON relayed_requests (id) WHERE taken_at_ms IS NULL;
-- What each replica polls: its answered requests.
CREATE INDEX relayed_requests_answered ON relayed_requests (replica, id) WHERE answer IS NOT NULL;

-- Fleet requests a replica (a coordinator that does not lead) relays to the leader through the
-- store: the replica writes the request, the leader takes it (`taken_at_ms`), hands it to its
-- driver and writes the answer; the replica reads the answer back (deleting the row) and
-- answers the device. `replica` names the process that waits for the answer. `request` is the
-- CBOR of the relayed request (an update's delta included), emptied once answered.
-- (Postgres keeps it UNLOGGED; an SQLite store has no replicas, so this stays empty.)
CREATE TABLE relayed_requests (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    replica BIGINT NOT NULL,
    request BLOB NOT NULL,
    created_at_ms BIGINT NOT NULL,
    taken_at_ms BIGINT,
    answer BLOB,
    answered_at_ms BIGINT
);
-- What the leader polls: requests nobody took yet, in arrival order.
CREATE INDEX relayed_requests_waiting ON relayed_requests (id) WHERE taken_at_ms IS NULL;
-- What each replica polls: its answered requests.
CREATE INDEX relayed_requests_answered ON relayed_requests (replica, id) WHERE answer IS NOT NULL;

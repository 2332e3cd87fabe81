-- A round of a run whose next model is determined by what is already durable (the previous
-- model and server state, the round's stored updates) commits that model by its content hash
-- alone; the bytes follow off the round's path, and the round's updates are kept until they
-- land. A row whose data is NULL is such a model: a restart rebuilds it by replaying them.
-- SQLite cannot drop a NOT NULL constraint in place: the table is rebuilt (nothing refers
-- to it).
CREATE TABLE models_rebuilt (
    run_id BIGINT NOT NULL REFERENCES runs (id),
    version BIGINT NOT NULL,
    content_hash TEXT NOT NULL,
    data BLOB,
    round_idx BIGINT,
    created_at_ms BIGINT NOT NULL,
    PRIMARY KEY (run_id, version)
);
INSERT INTO models_rebuilt (run_id, version, content_hash, data, round_idx, created_at_ms)
    SELECT run_id, version, content_hash, data, round_idx, created_at_ms FROM models;
DROP TABLE models;
ALTER TABLE models_rebuilt RENAME TO models;
CREATE INDEX models_content_hash ON models (content_hash);

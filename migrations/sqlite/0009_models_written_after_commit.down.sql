-- Fails while a model's bytes are still to be written: start the coordinator once first (it
-- rebuilds them).
CREATE TABLE models_rebuilt (
    run_id BIGINT NOT NULL REFERENCES runs (id),
    version BIGINT NOT NULL,
    content_hash TEXT NOT NULL,
    data BLOB NOT NULL,
    round_idx BIGINT,
    created_at_ms BIGINT NOT NULL,
    PRIMARY KEY (run_id, version)
);
INSERT INTO models_rebuilt (run_id, version, content_hash, data, round_idx, created_at_ms)
    SELECT run_id, version, content_hash, data, round_idx, created_at_ms FROM models;
DROP TABLE models;
ALTER TABLE models_rebuilt RENAME TO models;
CREATE INDEX models_content_hash ON models (content_hash);

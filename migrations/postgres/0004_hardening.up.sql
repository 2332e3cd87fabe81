-- Hardening (issue 16).
-- The evaluation check reads a device's selections in one run.
CREATE INDEX selections_device ON selections (run_id, device_id);

-- Evaluations the coordinator only ever sees pooled over several devices (a secure round's
-- cohort evaluates the model it trains on inside the masked sum), one row per model version
-- and source.
CREATE TABLE aggregate_evaluations (
    run_id BIGINT NOT NULL REFERENCES runs (id),
    model_version BIGINT NOT NULL,
    source TEXT NOT NULL,
    n_devices BIGINT NOT NULL,
    example_count BIGINT NOT NULL,
    metrics_json TEXT NOT NULL,
    received_at_ms BIGINT NOT NULL,
    PRIMARY KEY (run_id, model_version, source)
);

-- The leadership epoch: a coordinator that takes the leadership lock increments it, and every
-- write of round state checks it in its own transaction, so a deposed leader's writes fail
-- instead of landing beside its successor's.
CREATE TABLE leadership (
    id BIGINT PRIMARY KEY,
    epoch BIGINT NOT NULL,
    holder TEXT,
    acquired_at_ms BIGINT
);
INSERT INTO leadership (id, epoch) VALUES (1, 0);

-- Starling's durable state: every round transition is a row, every acknowledged update a row.
CREATE TABLE devices (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    credential_hash TEXT NOT NULL UNIQUE,
    enrolled_at_ms BIGINT NOT NULL,
    revoked BOOLEAN NOT NULL DEFAULT FALSE
);

CREATE TABLE enrollment_tokens (
    token_hash TEXT PRIMARY KEY,
    created_at_ms BIGINT NOT NULL,
    expires_at_ms BIGINT,
    uses_left BIGINT
);

CREATE TABLE runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT,
    population TEXT NOT NULL,
    plan_json TEXT NOT NULL,
    status TEXT NOT NULL,
    model_version BIGINT NOT NULL DEFAULT 0,
    rounds_committed BIGINT NOT NULL DEFAULT 0,
    created_at_ms BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL
);

CREATE TABLE models (
    run_id BIGINT NOT NULL REFERENCES runs (id),
    version BIGINT NOT NULL,
    content_hash TEXT NOT NULL,
    data BLOB NOT NULL,
    round_idx BIGINT,
    created_at_ms BIGINT NOT NULL,
    PRIMARY KEY (run_id, version)
);
CREATE INDEX models_content_hash ON models (content_hash);

CREATE TABLE rounds (
    run_id BIGINT NOT NULL REFERENCES runs (id),
    round_idx BIGINT NOT NULL,
    model_version BIGINT NOT NULL,
    state TEXT NOT NULL,
    opened_at_ms BIGINT NOT NULL,
    selection_deadline_ms BIGINT NOT NULL,
    reporting_deadline_ms BIGINT NOT NULL,
    closed_at_ms BIGINT,
    n_selected BIGINT,
    n_reported BIGINT,
    n_dropped BIGINT,
    outcome_json TEXT,
    metrics_json TEXT,
    PRIMARY KEY (run_id, round_idx)
);

CREATE TABLE selections (
    run_id BIGINT NOT NULL,
    round_idx BIGINT NOT NULL,
    device_id BIGINT NOT NULL REFERENCES devices (id),
    selected_at_ms BIGINT NOT NULL,
    PRIMARY KEY (run_id, round_idx, device_id),
    FOREIGN KEY (run_id, round_idx) REFERENCES rounds (run_id, round_idx)
);

CREATE TABLE updates (
    run_id BIGINT NOT NULL,
    round_idx BIGINT NOT NULL,
    device_id BIGINT NOT NULL REFERENCES devices (id),
    slot BIGINT NOT NULL,
    example_count BIGINT NOT NULL,
    metrics_json TEXT NOT NULL,
    -- NULL once the round committed: the update then lives on in the committed model.
    delta BLOB,
    received_at_ms BIGINT NOT NULL,
    PRIMARY KEY (run_id, round_idx, device_id),
    UNIQUE (run_id, round_idx, slot),
    FOREIGN KEY (run_id, round_idx) REFERENCES rounds (run_id, round_idx)
);

CREATE TABLE evaluations (
    run_id BIGINT NOT NULL REFERENCES runs (id),
    model_version BIGINT NOT NULL,
    device_id BIGINT NOT NULL REFERENCES devices (id),
    example_count BIGINT NOT NULL,
    metrics_json TEXT NOT NULL,
    received_at_ms BIGINT NOT NULL,
    PRIMARY KEY (run_id, model_version, device_id)
);

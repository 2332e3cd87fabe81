-- The aggregator tier: which aggregator each selected device uploads to, and the partial
-- aggregates aggregators report. A partial is durable before its aggregator hears "accepted";
-- its sums are released (report set to NULL) when the round commits or fails, like updates.
ALTER TABLE selections ADD COLUMN aggregator_id BIGINT;

CREATE TABLE partials (
    run_id BIGINT NOT NULL,
    round_idx BIGINT NOT NULL,
    -- Shares the round's slot sequence with updates: the replay order after a restart.
    slot BIGINT NOT NULL,
    aggregators_json TEXT NOT NULL,
    devices_json TEXT NOT NULL,
    n_devices BIGINT NOT NULL,
    total_weight BIGINT NOT NULL,
    -- The CBOR PartialReport (sums, metrics, lists); NULL once the round closed.
    report BLOB,
    received_at_ms BIGINT NOT NULL,
    PRIMARY KEY (run_id, round_idx, slot),
    FOREIGN KEY (run_id, round_idx) REFERENCES rounds (run_id, round_idx)
);

-- A round's updates stored as the sums of groups of them. The coordinator folds the updates
-- that arrive while its previous write is under way into one group and writes the group's
-- sums (16 bytes a parameter, however many updates) with a row per update that keeps
-- everything but the delta: one transaction per group instead of a model-sized row per update.
-- Acknowledged once that transaction commits, as a lone update's row was.
CREATE TABLE update_groups (
    run_id BIGINT NOT NULL,
    round_idx BIGINT NOT NULL,
    -- The slot of its last update: merged at that place of the round's slot order on replay.
    slot BIGINT NOT NULL,
    n_updates BIGINT NOT NULL,
    -- How many of them were within the run's norm bound (DP's adaptive clipping counts these).
    n_within_bound BIGINT NOT NULL,
    total_weight BIGINT NOT NULL,
    -- Per metric: [weighted sum, weight].
    metrics_json TEXT NOT NULL,
    -- Little-endian f64 high and low parts of the double-double sums (no bytes of low parts
    -- when they are all zero); NULL once released.
    sum_hi BLOB,
    sum_lo BLOB,
    received_at_ms BIGINT NOT NULL,
    PRIMARY KEY (run_id, round_idx, slot),
    FOREIGN KEY (run_id, round_idx) REFERENCES rounds (run_id, round_idx)
);
-- An update stored in a group keeps its L2 norm here (its delta is NULL from the start), so a
-- refused round can still be traced to its updates.
ALTER TABLE updates ADD COLUMN norm DOUBLE PRECISION;

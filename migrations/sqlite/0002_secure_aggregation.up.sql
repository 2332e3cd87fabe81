-- A secure round's durable protocol events (keys, relayed sealed shares, masked inputs,
-- unmasking shares, stage closings), replayed in seq order by a restarted coordinator.
-- Never an unmasked update: the masked inputs here are uniformly random without the masks.
-- Deleted when the round commits or fails.
CREATE TABLE secagg_records (
    run_id BIGINT NOT NULL,
    round_idx BIGINT NOT NULL,
    seq BIGINT NOT NULL,
    record BLOB NOT NULL,
    created_at_ms BIGINT NOT NULL,
    PRIMARY KEY (run_id, round_idx, seq),
    FOREIGN KEY (run_id, round_idx) REFERENCES rounds (run_id, round_idx)
);

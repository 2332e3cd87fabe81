-- Server optimizers (issue 17). A stateful optimizer's state (FedAvgM's momentum, the adaptive
-- optimizers' moments) after it produced model `model_version`, committed in the same
-- transaction as that model so that a restarted coordinator continues where it stopped. Only
-- the latest is kept.
CREATE TABLE optimizer_states (
    run_id BIGINT NOT NULL REFERENCES runs (id),
    model_version BIGINT NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (run_id, model_version)
);

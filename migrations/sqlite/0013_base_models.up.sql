-- Pretrained models an operator imported (`starling models import`), which a plan's `init`
-- names by content hash: the SHA-256 of the schema id of `tensors_json` and the data, as a
-- run's models are addressed. `data` is the tensors' little-endian f32 values in that order.
CREATE TABLE base_models (
    content_hash TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    tensors_json TEXT NOT NULL,
    data BLOB NOT NULL,
    created_at_ms BIGINT NOT NULL
);

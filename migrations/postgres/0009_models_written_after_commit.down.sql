-- Fails while a model's bytes are still to be written: start the coordinator once first (it
-- rebuilds them).
ALTER TABLE models ALTER COLUMN data SET NOT NULL;

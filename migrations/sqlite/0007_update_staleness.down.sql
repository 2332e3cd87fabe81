ALTER TABLE updates DROP COLUMN staleness;

-- Kept in step with the Postgres migrations: SQLite reads blob slices (substr) with no storage
-- setting to change.
SELECT 1;

-- Kept in step with the Postgres migrations: SQLite never compresses blobs, so there is no
-- storage setting to change.
SELECT 1;

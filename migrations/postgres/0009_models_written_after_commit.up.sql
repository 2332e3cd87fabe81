-- A round of a run whose next model is determined by what is already durable (the previous
-- model and server state, the round's stored updates) commits that model by its content hash
-- alone; the bytes follow off the round's path, and the round's updates are kept until they
-- land. A row whose data is NULL is such a model: a restart rebuilds it by replaying them.
ALTER TABLE models ALTER COLUMN data DROP NOT NULL;

-- The populations an enrollment token admits (a JSON array of names), copied onto each device
-- it enrolls: a device may check in only to those. NULL on rows from before this migration:
-- any population, as then.
ALTER TABLE enrollment_tokens ADD COLUMN populations_json TEXT;
ALTER TABLE devices ADD COLUMN populations_json TEXT;

-- A run that claims its population for itself (a simulation's, `exclusive_population` in its
-- plan): the primary key makes two such claims race to one winner. A claim whose run is no
-- longer running is stale and is cleared by the next claim.
CREATE TABLE population_claims (
    population TEXT PRIMARY KEY,
    run_id BIGINT NOT NULL
);

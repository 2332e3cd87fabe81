DROP TABLE population_claims;
ALTER TABLE devices DROP COLUMN populations_json;
ALTER TABLE enrollment_tokens DROP COLUMN populations_json;

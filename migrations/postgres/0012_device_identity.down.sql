ALTER TABLE devices DROP COLUMN identity_key;

ALTER TABLE runs DROP COLUMN stop_reason;

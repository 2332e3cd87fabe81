DROP TABLE partials;
ALTER TABLE selections DROP COLUMN aggregator_id;

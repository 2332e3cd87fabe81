ALTER TABLE updates DROP COLUMN norm;
DROP TABLE update_groups;

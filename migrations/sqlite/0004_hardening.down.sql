DROP TABLE leadership;
DROP TABLE aggregate_evaluations;
DROP INDEX selections_device;

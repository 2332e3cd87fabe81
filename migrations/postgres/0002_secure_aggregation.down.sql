DROP TABLE secagg_records;

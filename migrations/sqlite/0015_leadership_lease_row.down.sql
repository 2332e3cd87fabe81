DROP TABLE leadership_lease;

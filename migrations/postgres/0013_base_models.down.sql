DROP TABLE base_models;

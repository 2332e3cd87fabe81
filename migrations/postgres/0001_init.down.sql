DROP TABLE evaluations;
DROP TABLE updates;
DROP TABLE selections;
DROP TABLE rounds;
DROP TABLE models;
DROP TABLE runs;
DROP TABLE enrollment_tokens;
DROP TABLE devices;

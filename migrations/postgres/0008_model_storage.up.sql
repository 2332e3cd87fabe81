-- A committed model (and a stateful optimizer's moments) is f32 values, which pglz cannot
-- shrink; with the default EXTENDED storage every commit still paid for the attempt (a 4 MB
-- model: ~20 ms to insert instead of ~13). Stored uncompressed out of line, like the updates.
ALTER TABLE models ALTER COLUMN data SET STORAGE EXTERNAL;
ALTER TABLE optimizer_states ALTER COLUMN data SET STORAGE EXTERNAL;

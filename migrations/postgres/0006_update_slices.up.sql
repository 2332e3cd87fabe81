-- Robust aggregation reads each update back a slice at a time (substr). Stored uncompressed
-- out of line (EXTERNAL), a slice costs only the TOAST chunks it covers instead of
-- decompressing the whole update; f32 deltas barely compress anyway.
ALTER TABLE updates ALTER COLUMN delta SET STORAGE EXTERNAL;

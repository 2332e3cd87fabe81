-- Why a run stopped when the coordinator stopped it (rounds failing in a row, its privacy
-- accounting or a round's close failing, a plan this version refuses); NULL when the operator
-- stopped it or it did not stop.
ALTER TABLE runs ADD COLUMN stop_reason TEXT;

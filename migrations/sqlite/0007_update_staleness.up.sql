-- Asynchronous (FedBuff) runs fold an update trained on an older model with a discount that
-- depends on how many versions behind it is; a restart replays it with the same discount.
ALTER TABLE updates ADD COLUMN staleness INTEGER NOT NULL DEFAULT 0;

-- The Ed25519 public key a device registered when it enrolled (64 hex digits), with which it
-- signs its secure-aggregation key advertisements. NULL on devices enrolled before identities:
-- they may join plain runs, not secure ones.
ALTER TABLE devices ADD COLUMN identity_key TEXT;

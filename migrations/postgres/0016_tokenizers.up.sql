-- Hugging Face tokenizers an operator imported (`starling models import-tokenizer`), which a
-- plan's `model.tokenizer` names by content hash: the SHA-256 of `data`, the `tokenizer.json`
-- file as imported. `vocab_size` is one more than its largest token id.
CREATE TABLE tokenizers (
    content_hash TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    vocab_size BIGINT NOT NULL,
    data BYTEA NOT NULL,
    created_at_ms BIGINT NOT NULL
);

//! Hugging Face tokenizers as a plan names them (`model.tokenizer`): the coordinator checks an
//! imported `tokenizer.json` with this, and the SDK turns a device's text into the spec's token
//! windows with it, as Python's `tokenizers` does on the same file.

use sha2::{Digest, Sha256};

/// Why a tokenizer file or a text was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    /// The bytes are not a `tokenizer.json` the `tokenizers` library loads.
    #[error("not a Hugging Face tokenizer.json: {0}")]
    Parse(String),
    /// The file has no tokens at all.
    #[error("the tokenizer has an empty vocabulary")]
    EmptyVocabulary,
    /// The bytes are not the file the hash names.
    #[error("the file is not tokenizer {expected} (its SHA-256 is {actual})")]
    NotTheNamedFile {
        /// The hash asked for.
        expected: String,
        /// The bytes' hash.
        actual: String,
    },
    /// The library failed on a text.
    #[error("tokenizing: {0}")]
    Encode(String),
    /// A token id is at or above the vocabulary the model takes.
    #[error("token id {id} is not below the model's vocabulary of {vocab}")]
    IdOutOfVocabulary {
        /// The id.
        id: u32,
        /// The model's vocabulary.
        vocab: u64,
    },
}

/// A loaded `tokenizer.json`.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    vocab_bound: u64,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer").field("vocab_bound", &self.vocab_bound).finish()
    }
}

/// Next-token examples: `windows.len() / length` windows of token ids, one label each.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TokenWindows {
    /// The windows' ids, window after window.
    pub windows: Vec<u32>,
    /// The id after each window.
    pub labels: Vec<u32>,
}

/// The content hash a tokenizer file is imported and named under: SHA-256 of its bytes, hex.
pub fn content_hash(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

impl TextTokenizer {
    /// Loads a `tokenizer.json`.
    pub fn parse(bytes: &[u8]) -> Result<Self, TokenizerError> {
        let inner = tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(|e| TokenizerError::Parse(e.to_string()))?;
        // Added tokens (special tokens among them) take ids of their own, past the model's.
        let top = inner.get_vocab(true).into_values().max();
        let vocab_bound = top.map(|id| u64::from(id) + 1).ok_or(TokenizerError::EmptyVocabulary)?;
        Ok(TextTokenizer { inner, vocab_bound })
    }

    /// Loads the `tokenizer.json` a plan names by `hash`, once `bytes` are that file.
    pub fn verified(bytes: &[u8], hash: &str) -> Result<Self, TokenizerError> {
        let actual = content_hash(bytes);
        if actual != hash {
            return Err(TokenizerError::NotTheNamedFile { expected: hash.to_owned(), actual });
        }
        Self::parse(bytes)
    }

    /// One more than its largest token id: the smallest vocabulary a model taking its ids has.
    pub fn vocab_bound(&self) -> u64 {
        self.vocab_bound
    }

    /// The ids of `text`, special tokens added as the file's post-processor says (Python's
    /// `Tokenizer.encode(text).ids`).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let encoding =
            self.inner.encode(text, true).map_err(|e| TokenizerError::Encode(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Next-token examples from `texts`, each tokenized alone: every window of `length` ids
    /// labelled with the id after it, at most `max` of them in all (0: every one). Refused when
    /// an id is at or above `vocab`, the vocabulary of the model that takes them.
    pub fn next_token_windows(
        &self,
        texts: &[String],
        length: usize,
        vocab: u64,
        max: usize,
    ) -> Result<TokenWindows, TokenizerError> {
        let mut out = TokenWindows::default();
        let full = |out: &TokenWindows| max > 0 && out.labels.len() >= max;
        for text in texts {
            if full(&out) {
                break;
            }
            let ids = self.encode(text)?;
            if let Some(&id) = ids.iter().find(|&&id| u64::from(id) >= vocab) {
                return Err(TokenizerError::IdOutOfVocabulary { id, vocab });
            }
            for window in ids.windows(length + 1) {
                if full(&out) {
                    break;
                }
                out.windows.extend_from_slice(&window[..length]);
                out.labels.push(window[length]);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A word-level tokenizer small enough to write by hand: four words and `[UNK]`.
    fn words() -> Vec<u8> {
        br#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": {"type": "Lowercase"}, "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "to": 1, "be": 2, "or": 3, "not": 4},
                      "unk_token": "[UNK]"}}"#
            .to_vec()
    }

    #[test]
    fn a_text_becomes_every_window_labelled_with_the_next_token() {
        let tokenizer = TextTokenizer::parse(&words()).unwrap();
        assert_eq!(tokenizer.vocab_bound(), 5);
        assert_eq!(
            tokenizer.encode("To be or NOT to be, quoth").unwrap(),
            [1, 2, 3, 4, 1, 2, 0, 0]
        );
        let texts = vec!["to be or not".to_owned(), "be".to_owned(), "or not to".to_owned()];
        let out = tokenizer.next_token_windows(&texts, 2, 5, 0).unwrap();
        assert_eq!(out.windows, [1, 2, 2, 3, 3, 4]);
        assert_eq!(out.labels, [3, 4, 1]);
        let capped = tokenizer.next_token_windows(&texts, 2, 5, 2).unwrap();
        assert_eq!((capped.windows.len(), capped.labels), (4, vec![3, 4]));
    }

    #[test]
    fn ids_beyond_the_models_vocabulary_are_refused() {
        let tokenizer = TextTokenizer::parse(&words()).unwrap();
        let texts = vec!["to be or not".to_owned()];
        assert_eq!(
            tokenizer.next_token_windows(&texts, 2, 4, 0),
            Err(TokenizerError::IdOutOfVocabulary { id: 4, vocab: 4 })
        );
    }

    #[test]
    fn a_file_is_taken_only_under_its_own_hash() {
        let file = words();
        let hash = content_hash(&file);
        assert!(TextTokenizer::verified(&file, &hash).is_ok());
        let mut other = file.clone();
        other.push(b' ');
        assert!(matches!(
            TextTokenizer::verified(&other, &hash),
            Err(TokenizerError::NotTheNamedFile { .. })
        ));
    }

    #[test]
    fn what_is_not_a_tokenizer_file_is_refused_with_the_reason() {
        for bad in [&b"{}"[..], b"not json", br#"{"model": {"type": "Nope"}}"#] {
            let err = TextTokenizer::parse(bad).unwrap_err();
            assert!(matches!(err, TokenizerError::Parse(_)), "{err}");
        }
    }
}

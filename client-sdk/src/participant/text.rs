//! A device's text, turned into the examples its task's model takes by the tokenizer the task
//! names: the tokenizer fetched once per device (and kept on disk beside the state file, by
//! content hash), the text tokenized once per tokenizer and input shape.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use starling_core::model_spec::InputSpec;
use starling_core::tokenizer::{TextTokenizer, TokenWindows, TokenizerError};
use starling_core::wire::TaskAssignment;

use super::ParticipantError;
use crate::examples::Examples;

/// The device's text: what it trains on and what it holds out for evaluation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeviceText {
    /// Texts to train on, each tokenized alone.
    pub train: Vec<String>,
    /// Texts to evaluate on.
    pub holdout: Vec<String>,
}

/// A tokenizer's content hash and the token input its windows are for.
type Key = (String, InputSpec);

/// The (train, holdout) examples made from the text.
type Made = (Arc<Examples>, Arc<Examples>);

/// The device's text and what it last became.
#[derive(Debug)]
pub(super) struct TextSource {
    text: DeviceText,
    tokenizer: Option<(String, Arc<TextTokenizer>)>,
    /// The (tokenizer, input) the examples below are for, and the (train, holdout) examples.
    tokenized: Option<(Key, Made)>,
}

impl TextSource {
    pub(super) fn new(text: DeviceText) -> Self {
        TextSource { text, tokenizer: None, tokenized: None }
    }

    /// The (train, holdout) examples of `task`'s model made from the text, when they were
    /// made before for its tokenizer and input; else what [`Self::examples_for`] needs.
    pub(super) fn cached(&self, task: &TaskAssignment) -> Result<Lookup, ParticipantError> {
        let key = key_of(task)?;
        Ok(match (&self.tokenized, &self.tokenizer) {
            (Some((made_for, (train, holdout))), _) if *made_for == key => {
                Lookup::Ready(train.clone(), holdout.clone())
            }
            (_, Some((hash, tokenizer))) if *hash == key.0 => Lookup::Tokenize(tokenizer.clone()),
            _ => Lookup::Fetch(key.0),
        })
    }

    /// Tokenizes the text with `tokenizer` for `task`'s model, off the async threads, and keeps
    /// the examples for the next task of the same tokenizer and input.
    pub(super) async fn examples_for(
        &mut self,
        task: &TaskAssignment,
        tokenizer: Arc<TextTokenizer>,
    ) -> Result<Made, ParticipantError> {
        let key = key_of(task)?;
        let InputSpec::Tokens { vocab, length } = key.1 else {
            unreachable!("key_of gives token inputs only")
        };
        let text = self.text.clone();
        let for_model = tokenizer.clone();
        let (train, holdout) = tokio::task::spawn_blocking(move || {
            let examples = |texts: &[String]| {
                let windows = for_model.next_token_windows(texts, length as usize, vocab, 0)?;
                Ok::<_, TokenizerError>(Arc::new(examples_of(key.1, windows)))
            };
            Ok::<_, TokenizerError>((examples(&text.train)?, examples(&text.holdout)?))
        })
        .await
        .expect("tokenizing panicked")?;
        self.tokenizer = Some((key.0.clone(), tokenizer));
        self.tokenized = Some((key, (train.clone(), holdout.clone())));
        Ok((train, holdout))
    }
}

/// What a task's text examples need.
pub(super) enum Lookup {
    /// Made before: (train, holdout).
    Ready(Arc<Examples>, Arc<Examples>),
    /// The tokenizer is loaded: tokenize.
    Tokenize(Arc<TextTokenizer>),
    /// Fetch the tokenizer of this hash first.
    Fetch(String),
}

/// The tokenizer a task names and the token input its model takes.
fn key_of(task: &TaskAssignment) -> Result<Key, ParticipantError> {
    let hash = task.tokenizer.clone().ok_or(ParticipantError::NoTokenizer)?;
    match task.model_spec.as_ref().map(|s| s.input) {
        Some(input @ InputSpec::Tokens { .. }) => Ok((hash, input)),
        _ => Err(ParticipantError::NoModelSpec),
    }
}

fn examples_of(input: InputSpec, windows: TokenWindows) -> Examples {
    let mut out = Examples::new(input);
    let length = Examples::width(input);
    let mut row = vec![0f32; length];
    for (window, &label) in windows.windows.chunks_exact(length).zip(&windows.labels) {
        for (r, &id) in row.iter_mut().zip(window) {
            *r = id as f32;
        }
        out.push(&row, label).expect("ids were checked against the vocabulary");
    }
    out
}

/// The file a device keeps tokenizer `hash` in, beside its state file.
pub(super) fn cache_file(state_file: &Path, hash: &str) -> PathBuf {
    state_file.with_file_name(format!("tokenizer-{hash}.json"))
}

/// The tokenizer kept in `file`, if it is there and is tokenizer `hash`.
pub(super) fn read_cached(file: &Path, hash: &str) -> Option<TextTokenizer> {
    TextTokenizer::verified(&std::fs::read(file).ok()?, hash).ok()
}

/// Keeps a verified tokenizer file (written aside and renamed, so a kill leaves no half file).
pub(super) fn write_cache(file: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let aside = file.with_extension("partial");
    std::fs::write(&aside, bytes)?;
    std::fs::rename(aside, file)
}

//! Hugging Face tokenizers on the device: the ids Starling's tokenizer gives are Python
//! `tokenizers`' on the same file, an operator imports a `tokenizer.json` and a plan names it,
//! and SDK devices train on their text tokenized with it.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use starling_client::data;
use starling_client::participant::{DeviceText, Outcome, Participant, ParticipantError};
use starling_core::RunId;
use starling_core::tokenizer::{TextTokenizer, content_hash};
use starling_core::wire::ErrorCode;
use starling_tests::*;

/// What the reference script reports of one tokenizer it trained.
#[derive(serde::Deserialize)]
struct Reference {
    file: String,
    vocab_bound: u64,
    ids: Vec<Vec<u32>>,
}

/// Four tokenizers trained in Python on Shakespeare, in the shapes of GPT-2's (byte-level BPE),
/// Llama's (SentencePiece BPE with byte fallback and `<s>`), BERT's (WordPiece, normalized,
/// `[CLS]`/`[SEP]`) and T5's (Unigram, NFKC, Metaspace): on every test string, accents, CJK,
/// emoji and special-token literals among them, Starling gives exactly Python's ids, and the
/// same vocabulary bound.
#[test]
fn tokenizers_give_the_ids_python_tokenizers_gives_on_the_same_file() {
    let Some(python) = python_with(&["tokenizers"]) else { return };
    let dir = tempfile::tempdir().unwrap();
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python/tokenizers_reference.py");
    let text = shared_data().join("shakespeare_roles/text.txt");
    let output = Command::new(python).arg(script).arg(text).arg(dir.path()).output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let mut reference: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&output.stdout).unwrap();
    let samples: Vec<String> =
        serde_json::from_value(reference.remove("samples").unwrap()).unwrap();
    assert_eq!(reference.len(), 4);
    for (name, tokenizer) in reference {
        let tokenizer: Reference = serde_json::from_value(tokenizer).unwrap();
        let ours = TextTokenizer::parse(&std::fs::read(&tokenizer.file).unwrap()).unwrap();
        assert_eq!(ours.vocab_bound(), tokenizer.vocab_bound, "{name}");
        for (sample, want) in samples.iter().zip(&tokenizer.ids) {
            assert_eq!(&ours.encode(sample).unwrap(), want, "{name} on {sample:?}");
        }
        // Not a tokenizer that maps everything to one id.
        let distinct: std::collections::HashSet<_> = tokenizer.ids.iter().flatten().collect();
        assert!(distinct.len() > 40, "{name}: {} distinct ids", distinct.len());
    }
}

/// A word-level tokenizer over the `words` most frequent words of `text` (lower-cased,
/// split on whitespace and punctuation), `[UNK]` at id 0.
pub(crate) fn word_tokenizer(text: &str, words: usize) -> Vec<u8> {
    let mut counts: BTreeMap<String, u64> = BTreeMap::new();
    for word in text.to_lowercase().split(|c: char| !c.is_alphanumeric() && c != '\'') {
        if !word.is_empty() {
            *counts.entry(word.to_owned()).or_default() += 1;
        }
    }
    let mut ranked: Vec<(String, u64)> = counts.into_iter().collect();
    ranked.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let mut vocab = serde_json::Map::new();
    vocab.insert("[UNK]".into(), 0.into());
    for (i, (word, _)) in ranked.into_iter().take(words).enumerate() {
        vocab.insert(word, (i + 1).into());
    }
    serde_json::to_vec(&serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": {"type": "Lowercase"}, "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    }))
    .unwrap()
}

/// A next-word model over `vocab` ids, windows of 8.
fn next_word_spec(vocab: u64) -> serde_json::Value {
    serde_json::json!({
        "input": {"kind": "tokens", "vocab": vocab, "length": 8},
        "layers": [{"kind": "embedding", "dim": 16}, {"kind": "lstm", "hidden": 32},
            {"kind": "last_step"}, {"kind": "linear", "out": vocab}]
    })
}

/// An operator imports a `tokenizer.json` (again: the same hash; not a tokenizer: 422) and a
/// plan names it; plans naming one nobody imported, one whose ids the model's vocabulary cannot
/// take, or one for a model without token input are refused by field. SDK devices holding
/// Shakespeare's text fetch it, keep it beside their state file, and train on the windows it
/// makes: each upload's example count is the windows of the device's text, and a device whose
/// run names no tokenizer uploads nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_train_on_their_text_with_the_tokenizer_the_plan_names() {
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let roles = data::shakespeare_roles(&shared_data().join("shakespeare_roles")).unwrap();
    let role = |id: &str| roles.iter().find(|r| r.id == id).unwrap().text.clone();
    let file = word_tokenizer(&roles.iter().map(|r| r.text.as_str()).collect::<String>(), 299);
    let imported = c.admin.import_tokenizer("shakespeare words", file.clone()).await.unwrap();
    assert_eq!(
        (imported.content_hash.as_str(), imported.vocab_size),
        (content_hash(&file).as_str(), 300)
    );
    let again = c.admin.import_tokenizer("again", file.clone()).await.unwrap();
    assert_eq!((again.content_hash, again.name), (imported.content_hash.clone(), imported.name));
    let refused = c.admin.import_tokenizer("not one", br#"{"model": 3}"#.to_vec()).await;
    assert_eq!(api_code(refused), Some(ErrorCode::InvalidField));
    assert_eq!(c.admin.tokenizers().await.unwrap().len(), 1);

    let hash = imported.content_hash;
    let plan = |spec: serde_json::Value, tokenizer: &str| {
        serde_json::json!({
            "model": {"spec": spec, "tokenizer": tokenizer},
            "training": {"epochs": 1, "batch_size": 16, "lr": 0.01, "optimizer": "adam"},
            "cohort_size": 2, "min_quorum": 2, "over_selection": 1.0,
            "selection_timeout_secs": 60.0, "reporting_timeout_secs": 120.0, "rounds": 2,
        })
    };
    for (spec, tokenizer, why) in [
        (next_word_spec(300), "0".repeat(64), "no imported tokenizer has content hash"),
        (next_word_spec(200), hash.clone(), "more than the model's input vocabulary of 200"),
        (
            serde_json::json!({"input": {"kind": "features", "size": 4},
                "layers": [{"kind": "linear", "out": 3}]}),
            hash.clone(),
            "needs a model spec whose input is tokens",
        ),
        (next_word_spec(300), "not a hash".into(), "64 lowercase hex digits"),
    ] {
        let err = c.admin.create_run(&plan(spec, &tokenizer)).await.unwrap_err().to_string();
        assert!(err.contains("model.tokenizer") && err.contains(why), "{err}");
    }
    let run = RunId(c.admin.create_run(&plan(next_word_spec(300), &hash)).await.unwrap().id);

    let tokenizer = TextTokenizer::parse(&file).unwrap();
    let token = c.admin.enrollment_token(2).await.unwrap();
    let state_dir = tempfile::tempdir().unwrap();
    let mut devices = vec![];
    let mut windows = vec![];
    for (k, id) in ["hamlet/HAMLET", "macbeth/MACBETH"].into_iter().enumerate() {
        let sentences: Vec<String> =
            role(id).split_inclusive(['.', '?', '!']).take(300).map(str::to_owned).collect();
        let (holdout, train) = sentences.split_at(60);
        let text = DeviceText { train: train.to_vec(), holdout: holdout.to_vec() };
        let count =
            |texts: &[String]| tokenizer.next_token_windows(texts, 8, 300, 0).unwrap().labels.len();
        windows.push((count(&text.train), count(&text.holdout)));
        let state_file = state_dir.path().join(format!("device-{k}.json"));
        let mut p = Participant::for_text(&c.url, "default", text).keeping_state_in(&state_file);
        p.enroll(&token).await.unwrap();
        devices.push(tokio::spawn(async move {
            let mut held_out = vec![];
            while held_out.len() < 2 {
                match p.participate(Box::new(|_| {})).await.unwrap() {
                    Outcome::Uploaded { evaluation, .. } => {
                        held_out.push(evaluation.unwrap().examples)
                    }
                    Outcome::ComeBackLater(_) | Outcome::RoundMissed { .. } => {
                        tokio::time::sleep(Duration::from_millis(100)).await
                    }
                    other => panic!("a run open to every device: {other:?}"),
                }
            }
            (p, held_out)
        }));
    }
    let mut participants = vec![];
    for (d, (_, holdout)) in devices.into_iter().zip(&windows) {
        let (p, held_out) = d.await.unwrap();
        assert_eq!(held_out, [*holdout as u64; 2], "each round evaluates on the held-out windows");
        participants.push(p);
    }
    wait_model(&c.admin, run, 2).await.unwrap();
    let mut counts: Vec<i64> = vec![];
    for round in 0..2 {
        let devices = c.admin.round_devices(run, round).await.unwrap();
        counts.extend(devices.iter().map(|d| d.example_count.expect("a plain run shows counts")));
    }
    counts.sort_unstable();
    let mut want: Vec<i64> = windows.iter().flat_map(|(t, _)| [*t as i64; 2]).collect();
    want.sort_unstable();
    assert_eq!(counts, want, "each upload counts the windows of its device's text");
    let kept = state_dir.path().join(format!("tokenizer-{hash}.json"));
    assert_eq!(std::fs::read(&kept).unwrap(), file, "the tokenizer is kept beside the state");

    // A run whose plan names no tokenizer: a device with text refuses it, uploading nothing.
    let mut untokenized = plan(next_word_spec(300), &hash);
    untokenized["model"].as_object_mut().unwrap().remove("tokenizer");
    untokenized["population"] = "plain".into();
    let plain = RunId(c.admin.create_run(&untokenized).await.unwrap().id);
    let token = c.admin.enrollment_token_for(1, &["plain"]).await.unwrap().token;
    let text = DeviceText { train: vec![role("hamlet/HAMLET")], holdout: vec![] };
    let mut p = Participant::for_text(&c.url, "plain", text);
    p.enroll(&token).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let refused = loop {
        match p.participate(Box::new(|_| {})).await {
            Ok(Outcome::ComeBackLater(_)) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            other => break other,
        }
    };
    assert!(matches!(refused, Err(ParticipantError::NoTokenizer)), "{refused:?}");
    let devices = c.admin.round_devices(plain, 0).await.unwrap();
    assert!(devices.iter().all(|d| d.reported.is_none()), "nothing uploaded: {devices:?}");
    c.running.shutdown().await.unwrap();
}

//! Hugging Face in and out, end to end: a small Llama-architecture model is pretrained centrally
//! with `transformers` on the roles of half of Shakespeare's plays (with a byte-level BPE
//! tokenizer trained on the same text), saved with `save_pretrained`, imported
//! (`hf_import`, the tokenizer beside it), fine-tuned federated with LoRA by SDK devices that
//! each hold one role of the other plays as text and tokenize it themselves, and its adapters
//! exported as PEFT's and loaded back with `peft`. Per round: next-token accuracy of the round's
//! model (merged) on the devices' held-out text, the bytes a device uploads, the devices'
//! training seconds; and the peak RSS of one device, which runs as a process of its own.
//! LoRA has r = 8, α = 16 on every linear map of both blocks and on the head, as the
//! `fine_tuning` bench's character model has.
//!
//! Needs PyTorch, `transformers` and `peft` (`STARLING_HF_PYTHON`, as `cargo xtask test` makes
//! it). Run with `cargo bench -p starling-tests --bench hf_fine_tuning --profile dev --
//! [--rounds N] [--steps S] [--lr L]` (default 10 rounds, 1 500 pretraining steps, devices'
//! Adam at 0.0003).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use starling_client::Device;
use starling_client::data;
use starling_client::examples::Examples;
use starling_client::model::{ModelIo, SpecModel};
use starling_client::participant::{DeviceText, Outcome, Participant, ParticipantProgress, Phase};
use starling_client::train::evaluate;
use starling_core::RunId;
use starling_core::model_spec::ModelSpec;
use starling_core::plan::Plan;
use starling_core::tensor::{f32_to_le_bytes, safetensors};
use starling_core::tokenizer::TextTokenizer;
use starling_tests::*;

/// Tokens of context.
const LENGTH: u64 = 32;
/// Devices (roles) fine-tuning, all in every round; the first runs as a process of its own.
const DEVICES: usize = 10;
/// Characters of each fine-tuning role's text a device holds.
const TEXT_PER_ROLE: usize = 6_000;

/// One device's text: every fifth sentence held out.
fn device_text(text: &str) -> DeviceText {
    let end =
        text.char_indices().map(|(i, _)| i).find(|&i| i >= TEXT_PER_ROLE).unwrap_or(text.len());
    let (mut train, mut holdout) = (vec![], vec![]);
    for (k, sentence) in text[..end].split_inclusive(['.', '?', '!']).enumerate() {
        let to = if k % 5 == 4 { &mut holdout } else { &mut train };
        to.push(sentence.trim().to_owned());
    }
    DeviceText { train, holdout }
}

/// Next-token windows of `texts` as examples of `input`.
fn windows(
    tokenizer: &TextTokenizer,
    texts: &[String],
    spec: &ModelSpec,
) -> anyhow::Result<Examples> {
    let starling_core::model_spec::InputSpec::Tokens { vocab, length } = spec.input else {
        anyhow::bail!("a model over tokens")
    };
    let made = tokenizer.next_token_windows(texts, length as usize, vocab, 0)?;
    let mut out = Examples::new(spec.input);
    for (window, &label) in made.windows.chunks_exact(length as usize).zip(&made.labels) {
        let row: Vec<f32> = window.iter().map(|&id| id as f32).collect();
        out.push(&row, label)?;
    }
    Ok(out)
}

/// Takes part in `rounds` rounds as one device holding `text`; the training seconds of each
/// round, by round.
async fn participate(mut p: Participant, rounds: u32) -> anyhow::Result<Vec<(i64, f64)>> {
    let mut times = vec![];
    while times.len() < rounds as usize {
        let since = Arc::new(Mutex::new((None::<Instant>, 0.0)));
        let mark = since.clone();
        let progress = Box::new(move |p: ParticipantProgress| {
            let mut mark = mark.lock().unwrap();
            match p {
                ParticipantProgress::Phase(Phase::Training) => mark.0 = Some(Instant::now()),
                ParticipantProgress::Phase(Phase::Uploading) => {
                    if let Some(t) = mark.0.take() {
                        mark.1 = t.elapsed().as_secs_f64();
                    }
                }
                _ => {}
            }
        });
        match p.participate(progress).await? {
            Outcome::Uploaded { round_idx, .. } => {
                times.push((round_idx.0, since.lock().unwrap().1))
            }
            Outcome::ComeBackLater(_) | Outcome::RoundMissed { .. } => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            other => anyhow::bail!("a run open to every device: {other:?}"),
        }
    }
    Ok(times)
}

/// This process's peak resident set, KiB (`VmHWM`).
fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// The device that runs alone: `--one-device URL TOKEN TEXT_JSON ROUNDS`; prints its training
/// seconds by round and its peak RSS.
async fn one_device(args: &[String]) -> anyhow::Result<()> {
    let [url, token, file, rounds] = args else {
        anyhow::bail!("--one-device URL TOKEN FILE ROUNDS")
    };
    let text: serde_json::Value = serde_json::from_slice(&std::fs::read(file)?)?;
    let text = DeviceText {
        train: serde_json::from_value(text["train"].clone())?,
        holdout: serde_json::from_value(text["holdout"].clone())?,
    };
    let mut p = Participant::for_text(url, "default", text);
    p.enroll(token).await?;
    let times = participate(p, rounds.parse()?).await?;
    println!("{}", serde_json::json!({"times": times, "peak_rss_kib": peak_rss_kib()}));
    Ok(())
}

async fn bench(rounds: u32, steps: u32, lr: f64) -> anyhow::Result<()> {
    let python =
        hf_python().ok_or_else(|| anyhow::anyhow!("needs PyTorch, transformers and peft"))?;
    let roles = data::shakespeare_roles(&shared_data().join("shakespeare_roles"))?;
    let play = |id: &str| id.split('/').next().unwrap_or_default().to_owned();
    let mut plays: Vec<String> = roles.iter().map(|r| play(&r.id)).collect();
    plays.dedup();
    // Pretraining: the roles of every other play; fine-tuning: the largest roles of the rest.
    let pretrain_plays: Vec<&String> = plays.iter().step_by(2).collect();
    let (pretrain, mut rest): (Vec<_>, Vec<_>) =
        roles.iter().partition(|r| pretrain_plays.contains(&&play(&r.id)));
    rest.sort_by_key(|r| std::cmp::Reverse(r.text.len()));
    let dir = tempfile::tempdir()?;
    let corpus: String = pretrain.iter().map(|r| r.text.as_str()).collect::<Vec<_>>().join("\n");
    std::fs::write(dir.path().join("pretrain.txt"), &corpus)?;
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python");
    let output = std::process::Command::new(&python)
        .arg(script.join("hf_pretrain.py"))
        .arg(dir.path().join("pretrain.txt"))
        .arg(dir.path())
        .arg(steps.to_string())
        .output()?;
    anyhow::ensure!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let pretrained: serde_json::Value = serde_json::from_slice(&output.stdout)?;
    println!(
        "pretrained with transformers on {} roles of {} plays ({} chars, {} tokens): {} parameters, vocabulary {}, {} steps of 64 × {LENGTH} tokens, loss {:.3}, {:.0} s",
        pretrain.len(),
        pretrain_plays.len(),
        corpus.len(),
        pretrained["tokens"],
        pretrained["parameters"],
        pretrained["vocab"],
        pretrained["steps"],
        pretrained["loss"].as_f64().unwrap_or(f64::NAN),
        pretrained["seconds"].as_f64().unwrap_or(f64::NAN),
    );

    let read = |file: &str| std::fs::read(dir.path().join(file));
    let config = String::from_utf8(read("config.json")?)?;
    let imported = starling_core::hf_import::import(&config, &read("model.safetensors")?, LENGTH)?;
    let tokenizer_file = read("tokenizer.json")?;
    let tokenizer = TextTokenizer::parse(&tokenizer_file)?;
    let (_db_dir, db) = sqlite_db();
    let c = start_in_process(&db).await?;
    let file = safetensors::to_safetensors(
        &imported.schema,
        &f32_to_le_bytes(&imported.values),
        &Default::default(),
    );
    let base_hash = c.admin.import_base_model("shakespeare llama", file).await?.content_hash;
    let tokenizer_hash =
        c.admin.import_tokenizer("shakespeare bpe", tokenizer_file).await?.content_hash;
    let base = imported.spec.clone();
    let mut spec = base.clone();
    let head = format!("layers.{}.Linear", base.layers.len() - 1);
    spec.lora = Some(serde_json::from_value(
        serde_json::json!({"rank": 8, "alpha": 16.0, "targets": ["*.LlamaBlock.*", head]}),
    )?);
    let plan = serde_json::json!({
        "model": {"spec": spec, "init": {"kind": "base_model", "hash": base_hash},
            "tokenizer": tokenizer_hash},
        "training": {"epochs": 1, "batch_size": 16, "lr": lr, "optimizer": "adam"},
        "cohort_size": DEVICES, "min_quorum": DEVICES, "over_selection": 1.0,
        "selection_timeout_secs": 600.0, "reporting_timeout_secs": 1200.0, "rounds": rounds,
    });
    let validated = serde_json::from_value::<Plan>(plan.clone())?.validate()?;
    let update_bytes = validated.update_schema().byte_len();
    let run = RunId(c.admin.create_run(&plan).await?.id);
    let texts: Vec<DeviceText> = rest[..DEVICES].iter().map(|r| device_text(&r.text)).collect();
    let mut held_out = Examples::new(base.input);
    for t in &texts {
        held_out.extend(&windows(&tokenizer, &t.holdout, &base)?);
    }
    let trains: usize =
        texts.iter().map(|t| windows(&tokenizer, &t.train, &base).map_or(0, |e| e.len())).sum();
    println!(
        "fine-tuning: {DEVICES} devices (roles of the other plays), {trains} training and {} held-out windows of {LENGTH} tokens; LoRA r = 8 (α 16) on every linear map of the blocks and the head; E = 1, B = 16, Adam at {lr}",
        held_out.len()
    );
    let token = c.admin.enrollment_token(DEVICES as i64).await?;
    let started = Instant::now();

    let alone_file = dir.path().join("device-0.json");
    let alone_text = serde_json::json!({"train": texts[0].train, "holdout": texts[0].holdout});
    std::fs::write(&alone_file, serde_json::to_vec(&alone_text)?)?;
    let alone = tokio::process::Command::new(std::env::current_exe()?)
        .args(["--one-device", &c.url, &token])
        .arg(&alone_file)
        .arg(rounds.to_string())
        .output();
    let alone = tokio::spawn(alone);
    let mut devices = vec![];
    for text in &texts[1..] {
        let mut p = Participant::for_text(&c.url, "default", text.clone());
        p.enroll(&token).await?;
        devices.push(tokio::spawn(participate(p, rounds)));
    }
    let mut times: Vec<(i64, f64)> = vec![];
    for d in devices {
        times.extend(d.await??);
    }
    let alone = alone.await??;
    anyhow::ensure!(alone.status.success(), "{}", String::from_utf8_lossy(&alone.stderr));
    let alone: serde_json::Value = serde_json::from_slice(&alone.stdout)?;
    let alone_times: Vec<(i64, f64)> = serde_json::from_value(alone["times"].clone())?;
    times.extend(&alone_times);
    wait_model(&c.admin, run, i64::from(rounds)).await?;
    let seconds = started.elapsed().as_secs_f64();

    let observer = enroll(&c.url, &c.admin, 1).await?.remove(0);
    let (flex, io) = (Device::flex(), ModelIo::of_spec(&base)?);
    let lora_schema = spec.schema()?;
    println!(
        "\n| round | accuracy of its model (held-out, merged) | upload B/device | device training s (mean / max) |"
    );
    println!("|---|---|---|---|");
    let mut last = vec![];
    for v in 0..=i64::from(rounds) {
        let values =
            model_values(&observer, &wait_model(&c.admin, run, v).await?, &lora_schema).await?;
        let merged = spec.merge_lora(&values)?;
        let model = SpecModel::build(&base, &flex)?.load_parameters(&merged)?;
        let accuracy = evaluate(&model, io, &held_out, &flex)?.accuracy;
        let round: Vec<f64> = times.iter().filter(|(r, _)| *r == v).map(|(_, s)| *s).collect();
        let (upload, training) = match round.len() {
            0 => ("-".to_owned(), "-".to_owned()),
            n => (
                update_bytes.to_string(),
                format!(
                    "{:.2} / {:.2}",
                    round.iter().sum::<f64>() / n as f64,
                    round.iter().fold(0.0f64, |a, b| a.max(*b))
                ),
            ),
        };
        println!("| {v} | {accuracy:.3} | {upload} | {training} |");
        last = values;
    }
    println!(
        "\n{rounds} rounds in {seconds:.0} s; one device's peak RSS (a process of its own, tokenizer and model included): {:.1} MiB",
        alone["peak_rss_kib"].as_f64().unwrap_or(0.0) / 1024.0
    );

    // The adapters out as PEFT's, loaded back with peft onto the transformers checkpoint.
    let peft_dir = dir.path().join("peft");
    std::fs::create_dir_all(&peft_dir)?;
    let mut adapter_bytes = 0;
    for (name, bytes) in starling_core::hf_export::peft_adapters(&spec, &last)? {
        adapter_bytes += bytes.len();
        std::fs::write(peft_dir.join(name), bytes)?;
    }
    let merged_dir = dir.path().join("merged");
    std::fs::create_dir_all(&merged_dir)?;
    for (name, bytes) in starling_core::hf_export::checkpoint(&base, &spec.merge_lora(&last)?)? {
        std::fs::write(merged_dir.join(name), bytes)?;
    }
    let ids: Vec<Vec<i64>> = held_out.features()[..4 * LENGTH as usize]
        .chunks_exact(LENGTH as usize)
        .map(|w| w.iter().map(|&v| v as i64).collect())
        .collect();
    let output = std::process::Command::new(&python)
        .arg(script.join("peft_check.py"))
        .arg(dir.path())
        .arg(&peft_dir)
        .arg(&merged_dir)
        .arg(serde_json::to_string(&ids)?)
        .output()?;
    anyhow::ensure!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let theirs: std::collections::BTreeMap<String, Vec<Vec<f64>>> =
        serde_json::from_slice(&output.stdout)?;
    let model = SpecModel::build(&spec, &flex)?.load_parameters(&last)?;
    let flat: Vec<i64> = ids.iter().flatten().copied().collect();
    let tokens =
        starling_client::burn::tensor::Tensor::<2, starling_client::burn::tensor::Int>::from_data(
            starling_client::burn::tensor::TensorData::new(flat, [ids.len(), LENGTH as usize]),
            &flex,
        );
    let ours = model
        .forward(starling_client::model::Batch::Tokens(tokens))
        .into_data()
        .try_to_vec::<f32>()?;
    let worst = theirs["peft"]
        .iter()
        .flatten()
        .zip(&ours)
        .map(|(a, b)| (a - f64::from(*b)).abs())
        .fold(0.0, f64::max);
    println!(
        "PEFT adapters: {adapter_bytes} bytes (adapter_config.json + adapter_model.safetensors); loaded with peft onto the transformers checkpoint, logits within {worst:.1e} of Starling's"
    );
    c.running.shutdown().await?;
    Ok(())
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    if args.first().is_some_and(|a| a == "--one-device") {
        return one_device(&args[1..]).await;
    }
    let flag = |name: &str, default: u32| -> anyhow::Result<u32> {
        Ok(match args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)) {
            Some(v) => v.parse()?,
            None => default,
        })
    };
    let lr = match args.iter().position(|a| a == "--lr").and_then(|i| args.get(i + 1)) {
        Some(v) => v.parse()?,
        None => 0.0003,
    };
    bench(flag("--rounds", 10)?, flag("--steps", 1_500)?, lr).await
}

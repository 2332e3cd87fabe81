//! Hugging Face checkpoints in: small random GPT-2 and Llama checkpoints built with
//! `transformers`, imported, give the logits `transformers` gives on the same token ids.

use std::collections::BTreeMap;
use std::process::Command;

use starling_client::Device;
use starling_client::burn::tensor::{Int, Tensor, TensorData};
use starling_client::model::{Batch, SpecModel};
use starling_core::RunId;
use starling_core::hf_import::{HfImportError, import};
use starling_tests::*;

use crate::operator::{starling, stdout};

/// What the reference script reports of one checkpoint it built.
#[derive(serde::Deserialize)]
struct Reference {
    dir: String,
    ids: Vec<Vec<i64>>,
    logits: Vec<Vec<f64>>,
}

/// Builds the checkpoints with `transformers` into `dir`, or `None` (the test skips) without it.
fn checkpoints(dir: &std::path::Path) -> Option<BTreeMap<String, Reference>> {
    let python = hf_python()?;
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python/hf_reference.py");
    let output = Command::new(python).arg(script).arg(dir).output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    Some(serde_json::from_slice(&output.stdout).unwrap())
}

/// The checkpoint in `dir` imported over the reference's 12 tokens.
fn imported(dir: &str) -> starling_core::hf_import::Imported {
    let read = |file: &str| std::fs::read(std::path::Path::new(dir).join(file)).unwrap();
    let config = String::from_utf8(read("config.json")).unwrap();
    import(&config, &read("model.safetensors"), 12).unwrap()
}

/// GPT-2 (learned positions, GELU's tanh form, tied embeddings), Llama with grouped-query
/// attention and an untied head, and Llama with tied embeddings: each imported checkpoint's
/// next-token logits on fixed token ids are `transformers`' to 1e-4.
#[test]
fn imported_checkpoints_give_the_logits_transformers_gives() {
    let dir = tempfile::tempdir().unwrap();
    let Some(references) = checkpoints(dir.path()) else { return };
    assert_eq!(references.len(), 3);
    for (name, reference) in references {
        let imported = imported(&reference.dir);
        let logits = logits_of(&imported.spec, &imported.values, &reference.ids);
        let want: Vec<f64> = reference.logits.iter().flatten().copied().collect();
        assert_eq!(logits.len(), want.len(), "{name}");
        let worst =
            logits.iter().zip(&want).map(|(a, b)| (f64::from(*a) - b).abs()).fold(0.0, f64::max);
        let spread = want.iter().map(|v| v.abs()).fold(0.0, f64::max);
        eprintln!("{name}: largest logit difference {worst:.2e} (logits up to {spread:.2})");
        assert!(worst < 1e-4, "{name}: logits differ by {worst}");
        assert!(spread > 0.5, "{name}: logits too small to tell models apart");
    }
}

/// What is not a GPT-2 or Llama checkpoint, or is one Starling does not build, is refused by
/// what it is.
#[test]
fn checkpoints_starling_cannot_build_are_refused_by_name() {
    use starling_core::tensor::{TensorSchema, TensorSpec, safetensors};
    let weights = safetensors::to_safetensors(
        &TensorSchema {
            tensors: vec![TensorSpec {
                name: "w".into(),
                shape: vec![1],
                dtype: starling_core::tensor::DType::F32,
            }],
        },
        &[0; 4],
        &Default::default(),
    );
    let unsupported = |config: serde_json::Value| match import(&config.to_string(), &weights, 8) {
        Err(HfImportError::Unsupported(why)) => why,
        other => panic!("{other:?}"),
    };
    assert!(unsupported(serde_json::json!({"model_type": "bert"})).contains("\"bert\""));
    let llama = serde_json::json!({"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16,
        "max_position_embeddings": 16, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}});
    assert!(unsupported(llama.clone()).contains("rope scaling (llama3)"));
    let mut long = llama.clone();
    long["rope_parameters"] = serde_json::json!({"rope_theta": 5e5});
    long["max_position_embeddings"] = 4.into();
    assert!(unsupported(long).contains("more than the checkpoint's 4 positions"));
    let mut good = llama;
    good["rope_parameters"] = serde_json::json!({"rope_theta": 5e5});
    match import(&good.to_string(), &weights, 8) {
        Err(HfImportError::Tensor { name, why }) => {
            assert_eq!((name.as_str(), why.as_str()), ("model.embed_tokens.weight", "missing"))
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(import("{", &weights, 8), Err(HfImportError::Config(_))));
}

/// `starling models import-hf` stores a checkpoint as a base model and writes its spec; a LoRA
/// run started from it has the imported values as version 0, and `starling models export
/// --format peft` and `--format hf` write what core's export makes of that version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_line_imports_a_checkpoint_and_exports_a_lora_run_for_hugging_face() {
    use starling_core::hf_export::{checkpoint, peft_adapters};
    let dir = tempfile::tempdir().unwrap();
    let Some(references) = checkpoints(dir.path()) else { return };
    let (_db_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let checkpoint_dir = &references["llama_gqa"].dir;
    let spec_file = dir.path().join("spec.json");
    let args = ["models", "import-hf", checkpoint_dir, "--name", "tiny llama", "--length", "12"];
    let spec_arg = ["--spec-out", spec_file.to_str().unwrap()];
    let printed = stdout(&starling(&c.url, &[&args[..], &spec_arg[..]].concat()).await);
    let hash = printed.split_whitespace().next().unwrap().to_owned();
    assert!(printed.contains("(tiny llama: "), "{printed}");
    let mut spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&spec_file).unwrap()).unwrap();
    spec["lora"] = serde_json::json!({"rank": 4, "alpha": 8.0, "targets": ["*.query", "*.value"]});
    let plan = serde_json::json!({
        "model": {"spec": spec, "init": {"kind": "base_model", "hash": hash, "seed": 9}},
        "cohort_size": 1, "rounds": 1,
    });
    let run = RunId(c.admin.create_run(&plan).await.unwrap().id);
    let spec: starling_core::model_spec::ModelSpec = serde_json::from_value(spec).unwrap();
    let observer = enroll(&c.url, &c.admin, 1).await.unwrap().remove(0);
    let imported = imported(checkpoint_dir);
    let initial = wait_model(&c.admin, run, 0).await.unwrap();
    let values = model_values(&observer, &initial, &spec.schema().unwrap()).await.unwrap();
    assert_eq!(spec.merge_lora(&values).unwrap(), imported.values, "B = 0: the base as imported");

    let run_arg = run.0.to_string();
    for (format, files) in [
        ("peft", peft_adapters(&spec, &values).unwrap()),
        ("hf", checkpoint(&spec.without_lora(), &spec.merge_lora(&values).unwrap()).unwrap()),
    ] {
        let out = dir.path().join(format);
        let args = ["models", "export", &run_arg, "--version", "0", "--format", format, "--out"];
        stdout(&starling(&c.url, &[&args[..], &[out.to_str().unwrap()]].concat()).await);
        for (name, bytes) in files {
            assert_eq!(std::fs::read(out.join(name)).unwrap(), bytes, "{format}: {name}");
        }
    }
    c.running.shutdown().await.unwrap();
}

/// Next-token logits of `spec` with `values` on `ids` (rows of `length` tokens).
fn logits_of(
    spec: &starling_core::model_spec::ModelSpec,
    values: &[f32],
    ids: &[Vec<i64>],
) -> Vec<f32> {
    let device = Device::flex();
    let model = SpecModel::build(spec, &device).unwrap().load_parameters(values).unwrap();
    let (rows, length) = (ids.len(), ids[0].len());
    let flat: Vec<i64> = ids.iter().flatten().copied().collect();
    let ids = Tensor::<2, Int>::from_data(TensorData::new(flat, [rows, length]), &device);
    model.forward(Batch::Tokens(ids)).into_data().try_to_vec::<f32>().unwrap()
}

/// The Llama and GPT-2 checkpoints imported, with LoRA adapters on their queries, values
/// (GPT-2's fused into one `c_attn` adapter), one feed-forward map and the head, the adapters
/// far from zero: the PEFT export loaded with `peft` onto the `transformers` checkpoint, and the
/// merged Hugging Face export loaded alone, both give Starling's logits to 1e-4.
#[test]
fn peft_adapters_and_the_merged_checkpoint_load_in_hugging_face_with_starlings_logits() {
    let dir = tempfile::tempdir().unwrap();
    let Some(references) = checkpoints(dir.path()) else { return };
    for (name, ffn, head) in [
        ("llama_gqa", "layers.2.LlamaBlock.ffn_down", "layers.5.Linear"),
        ("gpt2", "layers.3.TransformerBlock.ffn_outer", "layers.6.Linear"),
    ] {
        let targets = ["*.query", "*.value", ffn, head];
        exports_agree_with_hugging_face(dir.path(), name, &references[name], &targets);
    }
}

fn exports_agree_with_hugging_face(
    dir: &std::path::Path,
    name: &str,
    reference: &Reference,
    targets: &[&str],
) {
    use starling_core::hf_export::{checkpoint, peft_adapters};
    let imported = imported(&reference.dir);
    let mut spec = imported.spec.clone();
    spec.lora = Some(
        serde_json::from_value(serde_json::json!({"rank": 2, "alpha": 6.0, "targets": targets}))
            .unwrap(),
    );
    // The base tensors as imported, every adapter value drawn in ±0.3.
    let base: std::collections::HashMap<_, _> = {
        let mut at = 0;
        imported
            .schema
            .tensors
            .iter()
            .map(|t| {
                let n = t.numel() as usize;
                at += n;
                (t.name.clone(), imported.values[at - n..at].to_vec())
            })
            .collect()
    };
    let mut rng = starling_core::rng::SplitMix64(5);
    let mut values = vec![];
    for t in spec.schema().unwrap().tensors {
        match base.get(&t.name) {
            Some(v) => values.extend_from_slice(v),
            None => values.extend((0..t.numel()).map(|_| (rng.unit() as f32 - 0.5) * 0.6)),
        }
    }
    let ours = logits_of(&spec, &values, &reference.ids);
    let write = |kind: &str, files: starling_core::hf_export::Files| {
        let out = dir.join(format!("{name}-{kind}"));
        std::fs::create_dir_all(&out).unwrap();
        for (file, bytes) in files {
            std::fs::write(out.join(file), bytes).unwrap();
        }
        out
    };
    let peft_dir = write("peft", peft_adapters(&spec, &values).unwrap());
    let merged = spec.merge_lora(&values).unwrap();
    let merged_dir = write("merged", checkpoint(&spec.without_lora(), &merged).unwrap());
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python/peft_check.py");
    let output = Command::new(hf_python().unwrap())
        .arg(script)
        .args([&reference.dir, peft_dir.to_str().unwrap(), merged_dir.to_str().unwrap()])
        .arg(serde_json::to_string(&reference.ids).unwrap())
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let theirs: BTreeMap<String, Vec<Vec<f64>>> = serde_json::from_slice(&output.stdout).unwrap();
    let base_logits = logits_of(&imported.spec, &imported.values, &reference.ids);
    let moved = ours.iter().zip(&base_logits).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert!(moved > 0.1, "{name}: the adapters change the logits ({moved})");
    for (how, logits) in theirs {
        let worst = logits
            .iter()
            .flatten()
            .zip(&ours)
            .map(|(a, b)| (a - f64::from(*b)).abs())
            .fold(0.0, f64::max);
        eprintln!("{name} {how}: largest logit difference {worst:.2e}");
        assert!(worst < 1e-4, "{name} {how}: logits differ by {worst}");
    }
}

//! Training part of a model: frozen tensors that keep their values and never travel, and
//! local tensors (personalization) that each device trains and keeps, checked at the
//! coordinator's store and with real SDK devices.

use std::time::Duration;

use starling_client::Device;
use starling_client::data;
use starling_client::participant::{Outcome, Participant};
use starling_coordinator::store::StoredContribution;
use starling_core::tensor::{TensorSchema, f32_from_le_bytes};
use starling_core::wire::{ErrorCode, UploadRequest};
use starling_core::{RoundIdx, RunId};
use starling_tests::*;

/// A frozen tensor, a shared one and a local head, as names in a plan.
fn three_part_plan() -> serde_json::Value {
    serde_json::json!({
        "model": {
            "schema": {"tensors": [
                {"name": "frozen.w", "shape": [4], "dtype": "f32"},
                {"name": "shared.w", "shape": [3], "dtype": "f32"},
                {"name": "head.w", "shape": [2], "dtype": "f32"}
            ]},
            "init": {"kind": "seeded", "seed": 3},
            "trainable": ["shared.*", "head.*"],
            "local": ["head.*"]
        },
        "cohort_size": 2, "min_quorum": 2, "over_selection": 1.0,
        "selection_timeout_secs": 30.0, "reporting_timeout_secs": 60.0, "rounds": 1,
    })
}

/// The coordinator asks for the shared tensor alone, refuses an upload carrying the frozen or
/// the local tensor, stores only the shared tensor's values, and moves only them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_update_tensors_are_uploaded_stored_and_aggregated() {
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let run = RunId(c.admin.create_run(&three_part_plan()).await.unwrap().id);
    let devices = enroll(&c.url, &c.admin, 2).await.unwrap();
    let tasks = expect_tasks(&devices).await.unwrap();
    let update_schema = tasks[0].update_schema.clone().expect("a run training part of its model");
    let names = |s: &TensorSchema| s.tensors.iter().map(|t| t.name.clone()).collect::<Vec<_>>();
    assert_eq!(names(&update_schema), ["shared.w"]);
    assert_eq!(tasks[0].local_tensors, ["head.w"]);

    let upload = |schema: &TensorSchema, delta: &[f32], examples: u64| UploadRequest {
        model_version: tasks[0].model_version,
        example_count: examples,
        metrics: Default::default(),
        delta: schema.encode_f32(delta),
    };
    // The whole model's delta (frozen and local tensors in it), and the shared tensor with the
    // local head: both refused, nothing stored.
    let with_head = TensorSchema { tensors: tasks[0].schema.tensors[1..].to_vec() };
    for (schema, n) in [(&tasks[0].schema, 9), (&with_head, 5)] {
        let refused = devices[0].upload(run, RoundIdx(0), &upload(schema, &vec![0.5; n], 10)).await;
        assert_eq!(api_code(refused), Some(ErrorCode::SchemaMismatch), "{:?}", names(schema));
    }
    let contributions = [(vec![0.25, -0.5, 1.0], 10), (vec![-1.0, 0.75, 0.5], 30)];
    devices[0]
        .upload(run, RoundIdx(0), &upload(&update_schema, &contributions[0].0, 10))
        .await
        .unwrap();
    // What the store holds for the device: the shared tensor's three values (in its group's
    // sums, times its 10 examples), nothing else.
    let store = starling_coordinator::store::SqlStore::connect(&db, false).await.unwrap();
    let mut stored = vec![];
    store
        .for_each_update(run, RoundIdx(0), |u| {
            stored.push(u);
            Ok(())
        })
        .await
        .unwrap();
    match &stored[..] {
        [StoredContribution::Group(g)] => {
            let expected: Vec<f64> =
                contributions[0].0.iter().map(|&v| 10.0 * f64::from(v)).collect();
            assert_eq!(g.group.sums.hi, expected);
        }
        other => panic!("stored {other:?}"),
    }
    devices[1]
        .upload(run, RoundIdx(0), &upload(&update_schema, &contributions[1].0, 30))
        .await
        .unwrap();

    let schema = &tasks[0].schema;
    let initial = model_values(&devices[0], &tasks[0].model_hash, schema).await.unwrap();
    let next = model_values(&devices[0], &wait_model(&c.admin, run, 1).await.unwrap(), schema)
        .await
        .unwrap();
    assert_eq!(next[..4], initial[..4], "the frozen tensor keeps its initial values");
    assert_eq!(next[7..], initial[7..], "the local head is not the coordinator's to move");
    assert_eq!(next[4..7], fedavg_expected(&initial[4..7], &contributions));
    c.running.shutdown().await.unwrap();
}

/// SDK devices train the digits MLP with its first layer frozen and its output layer local:
/// the coordinator's models keep the frozen and the local layer's initial values through every
/// round, while the hidden layer trains; each device keeps a head of its own, trained, which
/// it evaluates with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_devices_freeze_what_the_plan_freezes_and_keep_their_heads() {
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let digits = data::digits(&shared_data().join("sklearn_digits")).unwrap();
    let mut plan = mlp_plan(digits.input(), 2, 3);
    // flatten, linear (1), relu, linear (3), relu, linear (5)
    plan["model"]["trainable"] = serde_json::json!(["layers.3.*", "layers.5.*"]);
    plan["model"]["local"] = serde_json::json!(["layers.5.*"]);
    let run = RunId(c.admin.create_run(&plan).await.unwrap().id);
    let token = c.admin.enrollment_token(2).await.unwrap();
    let mut devices = vec![];
    for k in 0..2 {
        let shard = digits.subset(&(k * 400..(k + 1) * 400).collect::<Vec<_>>());
        let (train, hold) = shard.split_holdout(0.2, k as u64);
        let mut p = Participant::new(&c.url, "default", train, hold, Device::flex().autodiff());
        p.enroll(&token).await.unwrap();
        devices.push(tokio::spawn(uploading(p, 3)));
    }
    let mut participants = vec![];
    for d in devices {
        participants.push(d.await.unwrap());
    }
    let schema = plan_schema(&plan);
    let observer = enroll(&c.url, &c.admin, 1).await.unwrap().remove(0);
    let initial = model_values(&observer, &wait_model(&c.admin, run, 0).await.unwrap(), &schema)
        .await
        .unwrap();
    let last = model_values(&observer, &wait_model(&c.admin, run, 3).await.unwrap(), &schema)
        .await
        .unwrap();
    let range = |prefix| layer_range(&schema, prefix);
    let (frozen, hidden, head) = (range("layers.1."), range("layers.3."), range("layers.5."));
    assert_eq!(last[frozen.clone()], initial[frozen], "the frozen layer keeps its values");
    assert_eq!(last[head.clone()], initial[head.clone()], "no device sent its head");
    assert_ne!(last[hidden.clone()], initial[hidden], "the hidden layer trains");

    let heads: Vec<Vec<f32>> = participants
        .iter()
        .map(|p| {
            let part = p.state().local_parts.iter().find(|l| l.run_id == run).expect("a head kept");
            part.tensors.iter().flat_map(|t| f32_from_le_bytes(&t.values)).collect()
        })
        .collect();
    assert_eq!(heads[0].len(), head.len());
    assert_ne!(heads[0], initial[head.clone()], "a device trains its head");
    assert_ne!(heads[0], heads[1], "each device has its own head");
    c.running.shutdown().await.unwrap();
}

/// Where the tensors named `prefix...` (adjacent in the schema) lie in a flat model.
fn layer_range(schema: &TensorSchema, prefix: &str) -> std::ops::Range<usize> {
    let (mut start, mut end) = (None, 0);
    let mut offset = 0;
    for t in &schema.tensors {
        let n = t.numel() as usize;
        if t.name.starts_with(prefix) {
            start.get_or_insert(offset);
            end = offset + n;
        }
        offset += n;
    }
    start.expect("the prefix names a layer")..end
}

/// The schema a plan's spec gives.
fn plan_schema(plan: &serde_json::Value) -> TensorSchema {
    let spec: starling_core::model_spec::ModelSpec =
        serde_json::from_value(plan["model"]["spec"].clone()).unwrap();
    spec.schema().unwrap()
}

/// A small character transformer, with LoRA adapters on its attention's query and value maps
/// and on its output layer when `lora` is set.
pub(crate) fn char_transformer(lora: bool) -> starling_core::model_spec::ModelSpec {
    let mut spec = serde_json::json!({
        "input": {"kind": "tokens", "vocab": 80, "length": 20},
        "layers": [{"kind": "embedding", "dim": 16}, {"kind": "position_embedding"},
            {"kind": "transformer_block", "heads": 2, "width": 16, "ffn": 32},
            {"kind": "layer_norm"}, {"kind": "last_step"}, {"kind": "linear", "out": 80}]
    });
    if lora {
        spec["lora"] = serde_json::json!({"rank": 4, "alpha": 8.0, "targets": ["*.query", "*.value", "layers.5.Linear"]});
    }
    serde_json::from_value(spec).unwrap()
}

/// A base model pretrained centrally on one Shakespeare role is fine-tuned federated with LoRA
/// by SDK devices holding two other roles: devices upload the adapters alone, the base stays
/// as pretrained in every model, and the run exports the merged model (`W + (alpha/r)·A·B`,
/// as core computes it) and the adapters alone; the merged model predicts the devices' roles
/// better than the base did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lora_fine_tuning_sends_only_adapters_and_exports_the_merged_model() {
    use starling_client::model::{ModelIo, SpecModel};
    use starling_client::train::{LocalOptimizer, TrainingPlan, evaluate, train};
    use starling_core::tensor::safetensors;
    let roles = data::shakespeare_roles(&shared_data().join("shakespeare_roles")).unwrap();
    let role = |id: &str| roles.iter().find(|r| r.id == id).unwrap();
    let examples = |id: &str| data::next_char_examples(&role(id).text, 20, 400);

    // Pretraining, centrally, on Hamlet.
    let (base, lora) = (char_transformer(false), char_transformer(true));
    let io = ModelIo::of_spec(&base).unwrap();
    let device = Device::flex().autodiff();
    let model = SpecModel::build(&base, &device)
        .unwrap()
        .load_parameters(&base.initial_parameters(1).unwrap())
        .unwrap();
    let config = TrainingPlan {
        epochs: 3,
        batch_size: 32,
        lr: 0.005,
        optimizer: LocalOptimizer::Adam,
        ..Default::default()
    };
    let hamlet = examples("hamlet/HAMLET");
    let (pretrained, _) = train(model, io, &hamlet, &config, &device, &mut |_| {}).unwrap();
    let pretrained = pretrained.parameters();
    // The LoRA model starts as the pretrained one: its base tensors, adapters from the spec
    // (B zero).
    let lora_schema = lora.schema().unwrap();
    let mut initial = lora.initial_parameters(2).unwrap();
    let (mut at, mut from) = (0, 0);
    for t in &lora_schema.tensors {
        let n = t.numel() as usize;
        if !t.name.contains(".lora_") {
            initial[at..at + n].copy_from_slice(&pretrained[from..from + n]);
            from += n;
        }
        at += n;
    }
    assert_eq!(from, pretrained.len());

    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    use base64::Engine;
    let plan = serde_json::json!({
        "model": {"spec": lora, "init": {"kind": "parameters", "data_base64":
            base64::engine::general_purpose::STANDARD.encode(starling_core::tensor::f32_to_le_bytes(&initial))}},
        "training": {"epochs": 2, "batch_size": 32, "lr": 0.01, "optimizer": "adam"},
        "cohort_size": 2, "min_quorum": 2, "over_selection": 1.0,
        "selection_timeout_secs": 60.0, "reporting_timeout_secs": 120.0, "rounds": 2,
    });
    let run = RunId(c.admin.create_run(&plan).await.unwrap().id);
    let token = c.admin.enrollment_token(2).await.unwrap();
    let device_roles = ["romeo-and-juliet/ROMEO", "macbeth/MACBETH"];
    let mut devices = vec![];
    for id in device_roles {
        let (train_set, hold) = examples(id).split_holdout(0.1, 1);
        let mut p = Participant::new(&c.url, "default", train_set, hold, Device::flex().autodiff());
        p.enroll(&token).await.unwrap();
        devices.push(tokio::spawn(uploading(p, 2)));
    }
    for d in devices {
        d.await.unwrap();
    }
    let observer = enroll(&c.url, &c.admin, 1).await.unwrap().remove(0);
    let last = model_values(&observer, &wait_model(&c.admin, run, 2).await.unwrap(), &lora_schema)
        .await
        .unwrap();
    let mut offset = 0;
    for t in &lora_schema.tensors {
        let n = t.numel() as usize;
        let (was, is) = (&initial[offset..offset + n], &last[offset..offset + n]);
        if t.name.ends_with(".lora_b") {
            assert_ne!(was, is, "{} trains", t.name);
        } else if !t.name.contains(".lora_") {
            assert_eq!(was, is, "{} is the pretrained base's", t.name);
        }
        offset += n;
    }

    // The exports: the merged model in the base's schema, and the adapters alone.
    let merged_file = c.admin.model_part_file(run, 2, "merged").await.unwrap();
    let merged = f32_from_le_bytes(
        &safetensors::from_safetensors(&base.schema().unwrap(), &merged_file).unwrap(),
    );
    assert_eq!(merged, lora.merge_lora(&last).unwrap());
    let adapters_file = c.admin.model_part_file(run, 2, "adapters").await.unwrap();
    let adapter_schema = TensorSchema {
        tensors: lora_schema
            .tensors
            .iter()
            .filter(|t| t.name.contains(".lora_"))
            .cloned()
            .collect(),
    };
    assert_eq!(adapter_schema.tensors.len(), 6);
    safetensors::from_safetensors(&adapter_schema, &adapters_file).unwrap();
    // A part of a model that has no adapters is refused by name.
    let refused = c.admin.model_part_file(run, 2, "everything").await;
    assert_eq!(api_code(refused), Some(ErrorCode::InvalidField));

    // The merged model predicts the devices' roles better than the pretrained base did.
    let flex = Device::flex();
    let loss = |values: &[f32], id: &str| {
        let model = SpecModel::build(&base, &flex).unwrap().load_parameters(values).unwrap();
        evaluate(&model, io, &examples(id), &flex).unwrap().loss
    };
    for id in device_roles {
        let (before, after) = (loss(&pretrained, id), loss(&merged, id));
        eprintln!("{id}: next-character loss {before:.3} pretrained, {after:.3} fine-tuned");
        assert!(after < before, "{id}: {before} -> {after}");
    }
    c.running.shutdown().await.unwrap();
}

/// Each model's view, and the run's for its latest, gives how the devices' own accuracies
/// spread, each device once: here
/// 0.5, 0.75 and 1.0, whose population standard deviation is √(2·0.25² / 3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_models_view_gives_the_spread_of_its_device_accuracies() {
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let run = RunId(c.admin.create_run(&PlanSpec::all_of(3, 4, 1).json()).await.unwrap().id);
    let devices = enroll(&c.url, &c.admin, 3).await.unwrap();
    let tasks = expect_tasks(&devices).await.unwrap();
    for (device, (accuracy, examples)) in devices.iter().zip([(0.5, 10), (0.75, 200), (1.0, 30)]) {
        let report = starling_core::wire::EvaluationReport {
            model_version: tasks[0].model_version,
            example_count: examples,
            metrics: [("accuracy".to_owned(), accuracy), ("loss".to_owned(), 1.0)].into(),
        };
        device.evaluate(run, &report).await.unwrap();
    }
    let models = c.admin.models(run).await.unwrap();
    let spread = models[0].device_accuracy.expect("three device evaluations");
    assert_eq!((spread.devices, spread.min, spread.max), (3, 0.5, 1.0));
    assert!((spread.mean - 0.75).abs() < 1e-12, "{spread:?}");
    assert!((spread.std - (2.0 * 0.25f64.powi(2) / 3.0).sqrt()).abs() < 1e-12, "{spread:?}");
    // The federated accuracy beside it stays example-weighted: (5 + 150 + 30) / 240.
    assert!((models[0].evaluation["accuracy"] - 185.0 / 240.0).abs() < 1e-12);
    // The run view gives the latest such spread, and its model version.
    let view = c.admin.run(run).await.unwrap();
    assert_eq!((view.device_accuracy, view.device_accuracy_version), (Some(spread), Some(0)));
    c.running.shutdown().await.unwrap();
}

/// An operator imports a pretrained model as safetensors and a plan starts from it by content
/// hash: version 0 holds the imported tensors by name (in the run's order, whatever the file's),
/// and the LoRA adapters the base lacks start from the plan's seed. Importing it again gives
/// the same hash; a file that is not one of F32 tensors, a hash nobody imported and a model
/// with a tensor the base lacks are refused by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_starts_from_an_imported_model_named_by_its_hash() {
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let (base, lora) = (char_transformer(false), char_transformer(true));
    let (file, pretrained) = char_transformer_file();
    let imported = c.admin.import_base_model("char transformer", file.clone()).await.unwrap();
    assert_eq!(imported.schema.tensors.len(), base.schema().unwrap().tensors.len());
    let again = c.admin.import_base_model("the same again", file).await.unwrap();
    assert_eq!(
        (again.content_hash.as_str(), again.name.as_str()),
        (imported.content_hash.as_str(), "char transformer")
    );
    assert_eq!(c.admin.base_models().await.unwrap().len(), 1);
    let refused = c.admin.import_base_model("not a model", b"not safetensors".to_vec()).await;
    assert_eq!(api_code(refused), Some(ErrorCode::InvalidField));

    let plan = |spec: &starling_core::model_spec::ModelSpec, hash: &str| {
        serde_json::json!({
            "model": {"spec": spec, "init": {"kind": "base_model", "hash": hash, "seed": 4}},
            "cohort_size": 1, "rounds": 1,
        })
    };
    let run = RunId(c.admin.create_run(&plan(&lora, &imported.content_hash)).await.unwrap().id);
    let observer = enroll(&c.url, &c.admin, 1).await.unwrap().remove(0);
    let lora_schema = lora.schema().unwrap();
    let initial =
        model_values(&observer, &wait_model(&c.admin, run, 0).await.unwrap(), &lora_schema)
            .await
            .unwrap();
    let seeded = lora.initial_parameters(4).unwrap();
    let (mut at, mut from) = (0, 0);
    for t in &lora_schema.tensors {
        let n = t.numel() as usize;
        if t.name.contains(".lora_") {
            assert_eq!(initial[at..at + n], seeded[at..at + n], "{} from the seed", t.name);
        } else {
            assert_eq!(initial[at..at + n], pretrained[from..from + n], "{} imported", t.name);
            from += n;
        }
        at += n;
    }

    let refused = c.admin.create_run(&plan(&lora, &"0".repeat(64))).await;
    let err = refused.unwrap_err().to_string();
    assert!(err.contains("no imported model has content hash"), "{err}");
    let mut wider = serde_json::to_value(&base).unwrap();
    wider["layers"][2]["ffn"] = 64.into();
    let wider: starling_core::model_spec::ModelSpec = serde_json::from_value(wider).unwrap();
    let err =
        c.admin.create_run(&plan(&wider, &imported.content_hash)).await.unwrap_err().to_string();
    assert!(err.contains("ffn_inner.weight is [16, 32], the run's model needs [16, 64]"), "{err}");
    c.running.shutdown().await.unwrap();
}

/// A pretrained [`char_transformer`] as a safetensors file whose tensors are in reverse order
/// (names, not positions, place them), and its values in the model's order.
pub(crate) fn char_transformer_file() -> (Vec<u8>, Vec<f32>) {
    use starling_core::tensor::{f32_to_le_bytes, safetensors};
    let schema = char_transformer(false).schema().unwrap();
    let values: Vec<f32> =
        (0..schema.numel()).map(|i| ((i * 7919 % 1009) as f32 - 504.0) / 2048.0).collect();
    let mut chunks = vec![];
    let mut offset = 0;
    for t in &schema.tensors {
        let n = t.numel() as usize;
        chunks.push(&values[offset..offset + n]);
        offset += n;
    }
    let reversed = TensorSchema { tensors: schema.tensors.iter().rev().cloned().collect() };
    let data: Vec<f32> = chunks.iter().rev().flat_map(|c| c.iter().copied()).collect();
    (safetensors::to_safetensors(&reversed, &f32_to_le_bytes(&data), &Default::default()), values)
}

/// A LoRA run from an imported model: its tasks name the model, whose tensors the run never
/// trains, each round's download is the trained tensors alone (the adapters), and adapters of
/// another rank are refused as another schema. An SDK device
/// fetches the imported model once and keeps it beside its state file (a restarted device reads
/// it from there), and trains from the model it assembles: the base as imported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_fetch_the_imported_model_once_and_then_only_trained_tensors() {
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let lora = char_transformer(true);
    let (file, pretrained) = char_transformer_file();
    let hash = c.admin.import_base_model("char transformer", file).await.unwrap().content_hash;
    let plan = serde_json::json!({
        "model": {"spec": lora, "init": {"kind": "base_model", "hash": hash}},
        "training": {"epochs": 1, "batch_size": 32, "lr": 0.01, "optimizer": "adam"},
        "cohort_size": 2, "min_quorum": 2, "over_selection": 1.0,
        "selection_timeout_secs": 60.0, "reporting_timeout_secs": 120.0, "rounds": 3,
    });
    let run = RunId(c.admin.create_run(&plan).await.unwrap().id);
    // A raw device beside the SDK one: it reads the tasks and sends zero deltas.
    let raw = enroll(&c.url, &c.admin, 1).await.unwrap().remove(0);
    // A device enrolled for another population: the run's trained part is not for it.
    let outsider = enroll_in(&c.url, &c.admin, 1, &["elsewhere"]).await.unwrap().remove(0);
    let lora_schema = lora.schema().unwrap();
    let adapters: usize = (lora_schema.tensors.iter())
        .filter(|t| t.name.contains(".lora_"))
        .map(|t| t.numel() as usize)
        .sum();
    let raw_device = tokio::spawn(async move {
        for round in 0..3 {
            let task = wait_for("a task", Duration::from_secs(60), || async {
                Ok(match raw.check_in("default").await? {
                    starling_core::wire::CheckInResponse::Task(t) => Some(t),
                    _ => None,
                })
            })
            .await
            .unwrap();
            assert_eq!(task.base_model.as_deref(), Some(hash.as_str()));
            let update = task.update_schema.clone().unwrap();
            let part = raw.trained_part(run, &task.model_hash).await.unwrap();
            assert_eq!(part.data.len(), adapters * 4, "round {round}: the adapters alone");
            // Served again from the cache, the same bytes; never to another population's device.
            assert_eq!(raw.trained_part(run, &task.model_hash).await.unwrap(), part);
            let refused = outsider.trained_part(run, &task.model_hash).await;
            assert_eq!(api_code(refused), Some(ErrorCode::PopulationNotAllowed));
            let upload = |schema: &TensorSchema| UploadRequest {
                model_version: task.model_version,
                example_count: 1,
                metrics: Default::default(),
                delta: schema.encode_f32(&vec![0.0; schema.numel() as usize]),
            };
            // Adapters of another rank than the run's do not match its update: refused.
            let mut other_rank = update.clone();
            for t in &mut other_rank.tensors {
                // A is [in, rank], B is [rank, out].
                let rank_dim = if t.name.ends_with(".lora_b") { 0 } else { 1 };
                t.shape[rank_dim] = 2;
            }
            let refused = raw.upload(run, task.round_idx, &upload(&other_rank)).await;
            assert_eq!(api_code(refused), Some(ErrorCode::SchemaMismatch));
            raw.upload(run, task.round_idx, &upload(&update)).await.unwrap();
        }
    });

    let roles = data::shakespeare_roles(&shared_data().join("shakespeare_roles")).unwrap();
    let text = &roles.iter().find(|r| r.id == "macbeth/MACBETH").unwrap().text;
    let (train_set, hold) = data::next_char_examples(text, 20, 200).split_holdout(0.2, 1);
    let state_dir = tempfile::tempdir().unwrap();
    let state_file = state_dir.path().join("state.json");
    let cache = state_dir
        .path()
        .join(format!("base-model-{}.cbor", plan["model"]["init"]["hash"].as_str().unwrap()));
    let token = c.admin.enrollment_token(1).await.unwrap();
    let participant = |state: Option<starling_client::participant::ParticipantState>| {
        let p = Participant::new(
            &c.url,
            "default",
            train_set.clone(),
            hold.clone(),
            Device::flex().autodiff(),
        )
        .keeping_state_in(&state_file);
        match state {
            Some(state) => p.restore(state),
            None => p,
        }
    };
    let mut first = participant(None);
    first.enroll(&token).await.unwrap();
    let first = uploading(first, 1).await;
    let fetched = std::fs::metadata(&cache).expect("the imported model kept").modified().unwrap();
    let first = uploading(first, 1).await;
    // Restarted from its state file alone: the imported model is read from disk.
    let state = starling_client::participant::ParticipantState::load(&state_file).unwrap().unwrap();
    drop(first);
    uploading(participant(Some(state)), 1).await;
    assert_eq!(std::fs::metadata(&cache).unwrap().modified().unwrap(), fetched, "fetched once");
    raw_device.await.unwrap();

    let observer = enroll(&c.url, &c.admin, 1).await.unwrap().remove(0);
    let last = model_values(&observer, &wait_model(&c.admin, run, 3).await.unwrap(), &lora_schema)
        .await
        .unwrap();
    let (mut at, mut from) = (0, 0);
    for t in &lora_schema.tensors {
        let n = t.numel() as usize;
        if t.name.ends_with(".lora_b") {
            assert!(last[at..at + n].iter().any(|v| *v != 0.0), "{} trains", t.name);
        } else if !t.name.contains(".lora_") {
            assert_eq!(last[at..at + n], pretrained[from..from + n], "{} as imported", t.name);
            from += n;
        }
        at += n;
    }
    c.running.shutdown().await.unwrap();
}

/// Secure aggregation over part of a model: SDK devices mask and send only the update's tensors
/// (the hidden layer), the coordinator unmasks their sum alone, and the frozen first layer and
/// the devices' own output layers keep their initial values in every model it commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secure_run_sums_only_the_update_tensors() {
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let digits = data::digits(&shared_data().join("sklearn_digits")).unwrap();
    let mut plan = mlp_plan(digits.input(), 1, 2);
    plan["cohort_size"] = 3.into();
    plan["min_quorum"] = 3.into();
    plan["model"]["trainable"] = serde_json::json!(["layers.3.*", "layers.5.*"]);
    plan["model"]["local"] = serde_json::json!(["layers.5.*"]);
    plan["secure_aggregation"] =
        serde_json::json!({"clip": 1.0, "max_examples": 10_000, "stage_timeout_secs": 10.0});
    let run = RunId(c.admin.create_run(&plan).await.unwrap().id);
    let token = c.admin.enrollment_token(3).await.unwrap();
    let mut devices = vec![];
    for k in 0..3 {
        let shard = digits.subset(&(k * 300..(k + 1) * 300).collect::<Vec<_>>());
        let (train, hold) = shard.split_holdout(0.2, k as u64);
        let mut p = Participant::new(&c.url, "default", train, hold, Device::flex().autodiff());
        p.enroll(&token).await.unwrap();
        devices.push(tokio::spawn(uploading(p, 2)));
    }
    for d in devices {
        d.await.unwrap();
    }
    let schema = plan_schema(&plan);
    let observer = enroll(&c.url, &c.admin, 1).await.unwrap().remove(0);
    let initial = model_values(&observer, &wait_model(&c.admin, run, 0).await.unwrap(), &schema)
        .await
        .unwrap();
    let last = model_values(&observer, &wait_model(&c.admin, run, 2).await.unwrap(), &schema)
        .await
        .unwrap();
    let range = |prefix| layer_range(&schema, prefix);
    let (frozen, hidden, head) = (range("layers.1."), range("layers.3."), range("layers.5."));
    assert_eq!(last[frozen.clone()], initial[frozen]);
    assert_eq!(last[head.clone()], initial[head]);
    assert_ne!(last[hidden.clone()], initial[hidden]);
    let rounds = c.admin.rounds(run).await.unwrap();
    assert_eq!(rounds.iter().filter(|r| r.state == "committed").count(), 2);
    c.running.shutdown().await.unwrap();
}

/// `p` once it has uploaded `n` updates, waiting as the coordinator asks between tries.
async fn uploading(mut p: Participant, n: u32) -> Participant {
    let mut uploaded = 0;
    while uploaded < n {
        match p.participate(Box::new(|_| {})).await.unwrap() {
            Outcome::Uploaded { .. } => uploaded += 1,
            Outcome::ComeBackLater(_) | Outcome::RoundMissed { .. } => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            other => panic!("a training run open to every device: {other:?}"),
        }
    }
    p
}

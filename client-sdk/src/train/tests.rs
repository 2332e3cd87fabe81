//! Local training really learns (on real digits), FedProx pulls towards the global model, and
//! every bad input is an error before it reaches burn.

use burn::tensor::Device;
use starling_core::model_spec::ModelSpec;

use super::*;
use crate::data;
use crate::model::{ModelIo, SpecModel};

fn io(spec: &ModelSpec) -> ModelIo {
    ModelIo::of_spec(spec).unwrap()
}

fn digits_mlp() -> ModelSpec {
    serde_json::from_value(serde_json::json!({
        "input": {"kind": "image", "channels": 1, "height": 8, "width": 8},
        "layers": [{"kind": "flatten"}, {"kind": "linear", "out": 32}, {"kind": "relu"}, {"kind": "linear", "out": 10}]
    }))
    .unwrap()
}

fn digits() -> Examples {
    data::digits(&crate::data::tests::shared_data().join("sklearn_digits")).unwrap()
}

#[test]
fn training_on_real_digits_lowers_the_loss_and_learns() {
    learns_digits_on(Device::flex().autodiff());
}

/// The same on wgpu: a GPU where there is one, Mesa's lavapipe in CI (`cargo xtask test`
/// installs it and sets `STARLING_REQUIRE_WGPU`, so there a missing adapter fails the test).
#[test]
fn training_on_wgpu_lowers_the_loss_and_learns() {
    let backend = match crate::backend::select(crate::backend::BackendChoice::Wgpu) {
        Ok(backend) => backend,
        Err(e) if std::env::var_os("STARLING_REQUIRE_WGPU").is_none() => {
            starling_core::skipped::skipped(
                "training_on_wgpu_lowers_the_loss_and_learns",
                &e.to_string(),
            );
            return;
        }
        Err(e) => panic!("STARLING_REQUIRE_WGPU is set: {e}"),
    };
    eprintln!("training on {backend}");
    learns_digits_on(backend.training_device());
}

fn learns_digits_on(device: Device) {
    let spec = digits_mlp();
    let (train_set, test_set) = digits().split_holdout(0.2, 1);
    let model = SpecModel::build(&spec, &device)
        .unwrap()
        .load_parameters(&spec.initial_parameters(1).unwrap())
        .unwrap();
    let before = evaluate(&model, io(&spec), &test_set, &device).unwrap();
    let config = TrainingPlan { epochs: 5, batch_size: 16, lr: 0.1, ..TrainingPlan::default() };
    let mut steps = 0;
    let (model, report) =
        train(model, io(&spec), &train_set, &config, &device, &mut |_| steps += 1).unwrap();
    let after = evaluate(&model, io(&spec), &test_set, &device).unwrap();
    eprintln!(
        "held-out: loss {:.3} -> {:.3}, accuracy {:.3} -> {:.3}",
        before.loss, after.loss, before.accuracy, after.accuracy
    );
    assert_eq!(steps, 5 * train_set.len().div_ceil(16));
    assert_eq!(report.examples, train_set.len() as u64);
    assert!(after.loss < before.loss * 0.5, "loss {} -> {}", before.loss, after.loss);
    assert!(after.accuracy > 0.85, "held-out accuracy {}", after.accuracy);
}

/// A CNN (two convolutions, each with ReLU and a 2×2 pool, as the FedAvg paper's) on flex, where
/// it runs the SDK's own kernels (`model::cpu_kernels`): it learns the digits, and inside a
/// rayon pool (the simulator's training slots) it trains to the same model as from outside one.
#[test]
fn a_cnn_learns_real_digits_on_the_cpu_kernels_inside_a_pool_or_not() {
    let spec: ModelSpec = serde_json::from_value(serde_json::json!({
        "input": {"kind": "image", "channels": 1, "height": 8, "width": 8},
        "layers": [
            {"kind": "conv2d", "out_channels": 8, "kernel": 3, "padding": 1}, {"kind": "relu"},
            {"kind": "max_pool2d", "kernel": 2},
            {"kind": "conv2d", "out_channels": 16, "kernel": 3, "padding": 1}, {"kind": "relu"},
            {"kind": "max_pool2d", "kernel": 2},
            {"kind": "flatten"}, {"kind": "linear", "out": 10}
        ]
    }))
    .unwrap();
    let device = Device::flex().autodiff();
    assert!(cpu_kernels::flex_trains(&device));
    let (train_set, test_set) = digits().split_holdout(0.2, 1);
    let initial = spec.initial_parameters(1).unwrap();
    let config = TrainingPlan { epochs: 10, batch_size: 16, lr: 0.1, ..TrainingPlan::default() };
    let trained = || {
        let model = SpecModel::build(&spec, &device).unwrap().load_parameters(&initial).unwrap();
        train(model, io(&spec), &train_set, &config, &device, &mut |_| {}).unwrap().0
    };
    let model = trained();
    let before = SpecModel::build(&spec, &device).unwrap().load_parameters(&initial).unwrap();
    let before = evaluate(&before, io(&spec), &test_set, &device).unwrap();
    let after = evaluate(&model, io(&spec), &test_set, &device).unwrap();
    eprintln!("held-out accuracy {:.3} -> {:.3}", before.accuracy, after.accuracy);
    assert!(before.accuracy < 0.3, "untrained accuracy {}", before.accuracy);
    assert!(after.accuracy > 0.85, "held-out accuracy {}", after.accuracy);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let in_pool = pool.install(trained);
    let worst = model
        .parameters()
        .iter()
        .zip(in_pool.parameters())
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(worst < 1e-4, "trained inside a pool, parameters differ by {worst}");
}

/// The SDK's SGD (one pass, in place on flex) against burn's own `Sgd` with its default config:
/// the same gradients give bit-identical parameters, twice over (the second step in place on
/// parameters the first one wrote).
#[test]
fn plain_sgd_steps_exactly_as_burns_sgd() {
    use burn::optim::SgdConfig;
    let spec = digits_mlp();
    let device = Device::flex().autodiff();
    let examples = digits().subset(&(0..32).collect::<Vec<_>>());
    let mut ours_optim = ModuleOptimizer::from(PlainSgd);
    let mut burns_optim = SgdConfig::new().init();
    let mut ours = SpecModel::build(&spec, &device).unwrap();
    let mut burns = ours.clone();
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    for step in 0..2 {
        let idx: Vec<usize> = (step * 16..step * 16 + 16).collect();
        let grads_of = |model: &SpecModel| {
            let (input, targets) = examples.batch(&idx, &device);
            GradientsParams::from_grads(
                loss_fn.forward(model.forward(input), targets).backward(),
                model,
            )
        };
        let (ours_grads, burns_grads) = (grads_of(&ours), grads_of(&burns));
        ours = ours_optim.step(0.1, ours, ours_grads);
        burns = burns_optim.step(0.1, burns, burns_grads);
        assert_eq!(ours.parameters(), burns.parameters(), "after step {}", step + 1);
    }
    assert_ne!(ours.parameters(), SpecModel::build(&spec, &device).unwrap().parameters());
}

#[test]
fn adam_also_learns_and_fedprox_stays_closer_to_the_global_model() {
    let spec = digits_mlp();
    let device = Device::flex().autodiff();
    let examples = digits().subset(&(0..300).collect::<Vec<_>>());
    let global = spec.initial_parameters(2).unwrap();
    let distance = |mu: f64, optimizer| {
        let model = SpecModel::build(&spec, &device).unwrap().load_parameters(&global).unwrap();
        let config = TrainingPlan {
            epochs: 2,
            lr: 0.05,
            fedprox_mu: mu,
            optimizer,
            ..TrainingPlan::default()
        };
        let (model, report) =
            train(model, io(&spec), &examples, &config, &device, &mut |_| {}).unwrap();
        let d: f64 =
            model.parameters().iter().zip(&global).map(|(a, b)| f64::from(a - b).powi(2)).sum();
        (d.sqrt(), report.loss)
    };
    let (plain, _) = distance(0.0, LocalOptimizer::Sgd);
    let (prox, _) = distance(10.0, LocalOptimizer::Sgd);
    assert!(prox < plain * 0.8, "FedProx distance {prox} vs plain {plain}");
    let (_, adam_loss) = distance(0.0, LocalOptimizer::Adam);
    assert!(adam_loss < 2.0, "Adam's mean training loss {adam_loss}");
}

#[test]
fn bad_configs_and_examples_are_errors() {
    assert_eq!(TrainingPlan::from_json("null").unwrap(), TrainingPlan::default());
    assert_eq!(TrainingPlan::from_json(r#"{"epochs": 3, "optimizer": "adam"}"#).unwrap().epochs, 3);
    for bad in [
        r#"{"lr": -1}"#,
        r#"{"epochs": 0}"#,
        r#"{"momentum": 0.9}"#,
        "[1",
        r#"{"fedprox_mu": -0.1}"#,
    ] {
        assert!(TrainingPlan::from_json(bad).is_err(), "{bad}");
    }
    let spec = digits_mlp();
    let device = Device::flex().autodiff();
    let model = || SpecModel::build(&spec, &device).unwrap();
    let config = TrainingPlan::default();
    let empty = Examples::new(spec.input);
    assert!(matches!(
        train(model(), io(&spec), &empty, &config, &device, &mut |_| {}),
        Err(TrainError::NoExamples)
    ));
    let mut wrong_label = Examples::new(spec.input);
    wrong_label.push(&[0.0; 64], 10).unwrap();
    assert!(matches!(
        train(model(), io(&spec), &wrong_label, &config, &device, &mut |_| {}),
        Err(TrainError::Label { label: 10, classes: 10 })
    ));
    let other_input = Examples::new(starling_core::model_spec::InputSpec::Features { size: 64 });
    let mut other = other_input.clone();
    other.push(&[0.0; 64], 1).unwrap();
    assert!(matches!(
        evaluate(&model(), io(&spec), &other, &device),
        Err(TrainError::InputMismatch { .. })
    ));
    let mut store = Examples::new(spec.input);
    assert!(store.push(&[0.0; 63], 1).is_err());
    assert!(store.push(&[f32::NAN; 64], 1).is_err());
}

#[test]
fn an_lstm_learns_next_characters_of_a_shakespeare_role() {
    let (before, after) = next_characters_learned(
        serde_json::json!([{"kind": "embedding", "dim": 8}, {"kind": "lstm", "hidden": 32},
            {"kind": "last_step"}, {"kind": "linear", "out": 80}]),
        0.01,
    );
    assert!(after.loss < before.loss - 0.5, "loss {} -> {}", before.loss, after.loss);
}

#[test]
fn a_transformer_learns_next_characters_of_a_shakespeare_role() {
    let (before, after) = next_characters_learned(
        serde_json::json!([{"kind": "embedding", "dim": 16}, {"kind": "position_embedding"},
            {"kind": "transformer_block", "heads": 2, "width": 16, "ffn": 32},
            {"kind": "layer_norm"}, {"kind": "last_step"}, {"kind": "linear", "out": 80}]),
        0.005,
    );
    assert!(after.loss < before.loss - 0.5, "loss {} -> {}", before.loss, after.loss);
    // A model that always predicts the role's most common character (a space, ~16%) is beaten.
    assert!(after.accuracy > 0.2, "accuracy {}", after.accuracy);
}

/// A model of `layers` on 20 characters of context, before and after 4 epochs of Adam at `lr`
/// on 600 next-character examples of Hamlet's part, evaluated on them.
fn next_characters_learned(layers: serde_json::Value, lr: f64) -> (Evaluation, Evaluation) {
    let roles =
        data::shakespeare_roles(&crate::data::tests::shared_data().join("shakespeare_roles"))
            .unwrap();
    let hamlet = roles.iter().find(|r| r.id == "hamlet/HAMLET").unwrap();
    let examples = data::next_char_examples(&hamlet.text, 20, 600);
    let spec: ModelSpec = serde_json::from_value(serde_json::json!({
        "input": {"kind": "tokens", "vocab": 80, "length": 20}, "layers": layers
    }))
    .unwrap();
    let device = Device::flex().autodiff();
    let model = SpecModel::build(&spec, &device)
        .unwrap()
        .load_parameters(&spec.initial_parameters(1).unwrap())
        .unwrap();
    let before = evaluate(&model, io(&spec), &examples, &device).unwrap();
    let config = TrainingPlan {
        epochs: 4,
        batch_size: 32,
        lr,
        optimizer: LocalOptimizer::Adam,
        ..TrainingPlan::default()
    };
    let (model, _) = train(model, io(&spec), &examples, &config, &device, &mut |_| {}).unwrap();
    let after = evaluate(&model, io(&spec), &examples, &device).unwrap();
    eprintln!(
        "next-char loss {:.3} -> {:.3}, accuracy {:.3} -> {:.3}",
        before.loss, after.loss, before.accuracy, after.accuracy
    );
    (before, after)
}

/// Frozen tensors keep their loaded values through training, with SGD and with Adam, while
/// the others train; the loss still falls.
#[test]
fn frozen_tensors_keep_their_values_while_the_rest_trains() {
    let spec = digits_mlp();
    let device = Device::flex().autodiff();
    let values = spec.initial_parameters(1).unwrap();
    // layers.1 weight and bias frozen; layers.3 (the output layer) trains.
    let trains = [false, false, true, true];
    for optimizer in [LocalOptimizer::Sgd, LocalOptimizer::Adam] {
        let model = SpecModel::build(&spec, &device).unwrap();
        let model = crate::model::load_parameters_freezing(model, &values, &trains).unwrap();
        let examples = digits().subset(&(0..400).collect::<Vec<_>>());
        let before = evaluate(&model, io(&spec), &examples, &device).unwrap();
        let config =
            TrainingPlan { epochs: 3, batch_size: 16, lr: 0.05, optimizer, ..Default::default() };
        let (model, _) = train(model, io(&spec), &examples, &config, &device, &mut |_| {}).unwrap();
        let after = evaluate(&model, io(&spec), &examples, &device).unwrap();
        let trained = model.parameters();
        let hidden = 64 * 32 + 32;
        assert_eq!(trained[..hidden], values[..hidden], "{optimizer:?}: frozen layer moved");
        assert_ne!(trained[hidden..], values[hidden..], "{optimizer:?}: output layer still");
        assert!(after.loss < before.loss, "{optimizer:?}: loss {} -> {}", before.loss, after.loss);
    }
}

/// A device whose round closed while it trained used to train on to the end (a simulator's
/// clients then found the next rounds' cores busy, round after round). Training is given up at
/// the first step its caller says so, before any further step runs.
#[test]
fn training_is_given_up_at_the_first_step_its_caller_says_so() {
    let spec = digits_mlp();
    let device = Device::flex().autodiff();
    let examples = digits().subset(&(0..100).collect::<Vec<_>>());
    let config = TrainingPlan { epochs: 3, batch_size: 10, ..TrainingPlan::default() };
    let steps = std::cell::Cell::new(0usize);
    let model = SpecModel::build(&spec, &device).unwrap();
    let given_up = train_until(
        model,
        io(&spec),
        &examples,
        &config,
        &device,
        &mut |_| steps.set(steps.get() + 1),
        &|| steps.get() >= 4,
    );
    assert!(matches!(given_up, Err(TrainError::Abandoned)), "{:?}", given_up.err());
    assert_eq!(steps.get(), 4, "no step after the caller gave up");
    let model = SpecModel::build(&spec, &device).unwrap();
    let (_, report) =
        train_until(model, io(&spec), &examples, &config, &device, &mut |_| {}, &|| false).unwrap();
    assert_eq!(report.examples, 100);
}

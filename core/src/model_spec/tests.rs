//! Spec validation, shape inference and the derived schema, on the models the issues name.

use expect_test::{Expect, expect};

use super::*;

fn check(spec: serde_json::Value, expect: Expect) {
    let spec: ModelSpec = serde_json::from_value(spec).unwrap();
    let rendered = match spec.schema() {
        Ok(schema) => schema
            .tensors
            .iter()
            .map(|t| format!("{} {:?}", t.name, t.shape))
            .collect::<Vec<_>>()
            .join("\n"),
        Err(e) => format!("error: {e}"),
    };
    expect.assert_eq(&(rendered + "\n"));
}

#[test]
fn mnist_mlp() {
    check(
        serde_json::json!({"input": {"kind": "image", "channels": 1, "height": 28, "width": 28}, "layers": [
            {"kind": "flatten"}, {"kind": "linear", "out": 200}, {"kind": "relu"},
            {"kind": "linear", "out": 200}, {"kind": "relu"}, {"kind": "linear", "out": 10}
        ]}),
        expect![[r#"
            layers.1.Linear.weight [784, 200]
            layers.1.Linear.bias [200]
            layers.3.Linear.weight [200, 200]
            layers.3.Linear.bias [200]
            layers.5.Linear.weight [200, 10]
            layers.5.Linear.bias [10]
        "#]],
    );
}

#[test]
fn fedavg_cnn() {
    check(
        serde_json::json!({"input": {"kind": "image", "channels": 1, "height": 28, "width": 28}, "layers": [
            {"kind": "conv2d", "out_channels": 32, "kernel": 5, "padding": 2}, {"kind": "relu"}, {"kind": "max_pool2d", "kernel": 2},
            {"kind": "conv2d", "out_channels": 64, "kernel": 5, "padding": 2}, {"kind": "relu"}, {"kind": "max_pool2d", "kernel": 2},
            {"kind": "flatten"}, {"kind": "linear", "out": 512}, {"kind": "relu"}, {"kind": "dropout", "prob": 0.25},
            {"kind": "linear", "out": 10}
        ]}),
        expect![[r#"
            layers.0.Conv2d.weight [32, 1, 5, 5]
            layers.0.Conv2d.bias [32]
            layers.3.Conv2d.weight [64, 32, 5, 5]
            layers.3.Conv2d.bias [64]
            layers.7.Linear.weight [3136, 512]
            layers.7.Linear.bias [512]
            layers.10.Linear.weight [512, 10]
            layers.10.Linear.bias [10]
        "#]],
    );
}

#[test]
fn shakespeare_lstm() {
    check(
        serde_json::json!({"input": {"kind": "tokens", "vocab": 80, "length": 40}, "layers": [
            {"kind": "embedding", "dim": 8}, {"kind": "lstm", "hidden": 16}, {"kind": "layer_norm"},
            {"kind": "last_step"}, {"kind": "linear", "out": 80}
        ]}),
        expect![[r#"
            layers.0.Embedding.weight [80, 8]
            layers.1.Lstm.input_gate.input_transform.weight [8, 16]
            layers.1.Lstm.input_gate.input_transform.bias [16]
            layers.1.Lstm.input_gate.hidden_transform.weight [16, 16]
            layers.1.Lstm.input_gate.hidden_transform.bias [16]
            layers.1.Lstm.forget_gate.input_transform.weight [8, 16]
            layers.1.Lstm.forget_gate.input_transform.bias [16]
            layers.1.Lstm.forget_gate.hidden_transform.weight [16, 16]
            layers.1.Lstm.forget_gate.hidden_transform.bias [16]
            layers.1.Lstm.output_gate.input_transform.weight [8, 16]
            layers.1.Lstm.output_gate.input_transform.bias [16]
            layers.1.Lstm.output_gate.hidden_transform.weight [16, 16]
            layers.1.Lstm.output_gate.hidden_transform.bias [16]
            layers.1.Lstm.cell_gate.input_transform.weight [8, 16]
            layers.1.Lstm.cell_gate.input_transform.bias [16]
            layers.1.Lstm.cell_gate.hidden_transform.weight [16, 16]
            layers.1.Lstm.cell_gate.hidden_transform.bias [16]
            layers.2.LayerNorm.gamma [16]
            layers.2.LayerNorm.beta [16]
            layers.4.Linear.weight [16, 80]
            layers.4.Linear.bias [80]
        "#]],
    );
}

#[test]
fn shape_errors_name_the_layer() {
    let image = serde_json::json!({"kind": "image", "channels": 1, "height": 8, "width": 8});
    check(
        serde_json::json!({"input": image, "layers": [{"kind": "linear", "out": 10}]}),
        expect!["error: layer 0 (Linear) cannot take a Image(1, 8, 8) activation\n"],
    );
    check(
        serde_json::json!({"input": image, "layers": [{"kind": "conv2d", "out_channels": 4, "kernel": 9}, {"kind": "flatten"}, {"kind": "linear", "out": 2}]}),
        expect!["error: layer 0: kernel is larger than the padded input\n"],
    );
    check(
        serde_json::json!({"input": image, "layers": [{"kind": "flatten"}]}),
        expect![[r#"
            error: layer 0: the model has no trainable parameters
        "#]],
    );
    check(
        serde_json::json!({"input": image, "layers": [{"kind": "conv2d", "out_channels": 2, "kernel": 3}]}),
        expect!["error: the model must end in flat class logits, it ends in Image(2, 6, 6)\n"],
    );
    check(
        serde_json::json!({"input": image, "layers": []}),
        expect!["error: model spec has no layers\n"],
    );
}

#[test]
fn initialization_is_deterministic_and_layer_aware() {
    let spec: ModelSpec = serde_json::from_value(serde_json::json!({
        "input": {"kind": "features", "size": 4},
        "layers": [{"kind": "linear", "out": 3}, {"kind": "layer_norm"}, {"kind": "linear", "out": 2}]
    }))
    .unwrap();
    let a = spec.initial_parameters(7).unwrap();
    assert_eq!(a, spec.initial_parameters(7).unwrap());
    assert_ne!(a, spec.initial_parameters(8).unwrap());
    assert_eq!(a.len() as u64, spec.schema().unwrap().numel());
    let bound = 0.5f32; // sqrt(1 / fan_in) with fan_in = 4
    assert!(a[..12].iter().all(|v| v.abs() <= bound) && a[..12].iter().any(|v| *v != 0.0));
    assert_eq!(&a[12..15], &[0.0; 3], "bias");
    assert_eq!(&a[15..18], &[1.0; 3], "layer norm scale");
    assert_eq!(&a[18..21], &[0.0; 3], "layer norm shift");
}

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
fn character_transformer() {
    check(
        serde_json::json!({"input": {"kind": "tokens", "vocab": 80, "length": 40}, "layers": [
            {"kind": "embedding", "dim": 16}, {"kind": "position_embedding"},
            {"kind": "transformer_block", "heads": 2, "width": 16, "ffn": 64, "dropout": 0.1},
            {"kind": "layer_norm"}, {"kind": "last_step"}, {"kind": "linear", "out": 80}
        ]}),
        expect![[r#"
            layers.0.Embedding.weight [80, 16]
            layers.1.PositionEmbedding.weight [40, 16]
            layers.2.TransformerBlock.norm_attention.gamma [16]
            layers.2.TransformerBlock.norm_attention.beta [16]
            layers.2.TransformerBlock.query.weight [16, 16]
            layers.2.TransformerBlock.query.bias [16]
            layers.2.TransformerBlock.key.weight [16, 16]
            layers.2.TransformerBlock.key.bias [16]
            layers.2.TransformerBlock.value.weight [16, 16]
            layers.2.TransformerBlock.value.bias [16]
            layers.2.TransformerBlock.output.weight [16, 16]
            layers.2.TransformerBlock.output.bias [16]
            layers.2.TransformerBlock.norm_ffn.gamma [16]
            layers.2.TransformerBlock.norm_ffn.beta [16]
            layers.2.TransformerBlock.ffn_inner.weight [16, 64]
            layers.2.TransformerBlock.ffn_inner.bias [64]
            layers.2.TransformerBlock.ffn_outer.weight [64, 16]
            layers.2.TransformerBlock.ffn_outer.bias [16]
            layers.3.LayerNorm.gamma [16]
            layers.3.LayerNorm.beta [16]
            layers.5.Linear.weight [16, 80]
            layers.5.Linear.bias [80]
        "#]],
    );
}

/// A transformer block's sizes are checked against each other and the sequence it takes.
#[test]
fn bad_transformer_blocks_are_refused_by_name() {
    let block = |heads: u64, width: u64, ffn: u64, dropout: f64| {
        serde_json::json!({"input": {"kind": "tokens", "vocab": 10, "length": 4}, "layers": [
            {"kind": "embedding", "dim": 8},
            {"kind": "transformer_block", "heads": heads, "width": width, "ffn": ffn, "dropout": dropout},
            {"kind": "last_step"}, {"kind": "linear", "out": 10}]})
    };
    check(
        block(2, 8, 16, 0.0),
        expect![[r#"
        layers.0.Embedding.weight [10, 8]
        layers.1.TransformerBlock.norm_attention.gamma [8]
        layers.1.TransformerBlock.norm_attention.beta [8]
        layers.1.TransformerBlock.query.weight [8, 8]
        layers.1.TransformerBlock.query.bias [8]
        layers.1.TransformerBlock.key.weight [8, 8]
        layers.1.TransformerBlock.key.bias [8]
        layers.1.TransformerBlock.value.weight [8, 8]
        layers.1.TransformerBlock.value.bias [8]
        layers.1.TransformerBlock.output.weight [8, 8]
        layers.1.TransformerBlock.output.bias [8]
        layers.1.TransformerBlock.norm_ffn.gamma [8]
        layers.1.TransformerBlock.norm_ffn.beta [8]
        layers.1.TransformerBlock.ffn_inner.weight [8, 16]
        layers.1.TransformerBlock.ffn_inner.bias [16]
        layers.1.TransformerBlock.ffn_outer.weight [16, 8]
        layers.1.TransformerBlock.ffn_outer.bias [8]
        layers.3.Linear.weight [8, 10]
        layers.3.Linear.bias [10]
    "#]],
    );
    check(
        block(3, 8, 16, 0.0),
        expect![[r#"
        error: layer 1: 3 heads do not split width 8 evenly
    "#]],
    );
    check(
        block(0, 8, 16, 0.0),
        expect![[r#"
        error: layer 1: 0 heads do not split width 8 evenly
    "#]],
    );
    check(
        block(2, 16, 16, 0.0),
        expect![[r#"
        error: layer 1: width 16 must equal the 8 features of the sequence it takes
    "#]],
    );
    check(
        block(2, 8, 0, 0.0),
        expect![[r#"
        error: layer 1: ffn width must be in 1..=16777216
    "#]],
    );
    check(
        block(2, 8, u64::MAX, 0.0),
        expect![[r#"
        error: layer 1: ffn width must be in 1..=16777216
    "#]],
    );
    check(
        block(2, 8, 16, 1.0),
        expect![[r#"
        error: layer 1: dropout probability must be in [0, 1)
    "#]],
    );
    // A block takes a sequence, not flat features.
    check(
        serde_json::json!({"input": {"kind": "features", "size": 8}, "layers": [
            {"kind": "transformer_block", "heads": 2, "width": 8, "ffn": 16},
            {"kind": "linear", "out": 2}]}),
        expect![[r#"
            error: layer 0 (TransformerBlock) cannot take a Flat(8) activation
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

/// Sizes near u64's range made shape inference overflow (a panic in debug builds, a
/// wrapped schema the SDK then panicked on in release builds). Each is now refused by name.
#[test]
fn overflowing_sizes_are_refused_not_wrapped() {
    let image = |c: u64, side: u64| serde_json::json!({"kind": "image", "channels": c, "height": side, "width": side});
    check(
        serde_json::json!({"input": image(1, 8), "layers": [
            {"kind": "conv2d", "out_channels": 2, "kernel": 3, "padding": u64::MAX / 2 + 1},
            {"kind": "flatten"}, {"kind": "linear", "out": 2}]}),
        expect![[r#"
            error: layer 0: kernel must be in 1..=16777216 and padding at most 16777216
        "#]],
    );
    check(
        serde_json::json!({"input": image(1, 8), "layers": [
            {"kind": "conv2d", "out_channels": 2, "kernel": u64::MAX, "padding": 1},
            {"kind": "flatten"}, {"kind": "linear", "out": 2}]}),
        expect![[r#"
            error: layer 0: kernel must be in 1..=16777216 and padding at most 16777216
        "#]],
    );
    check(
        serde_json::json!({"input": image(1 << 24, 1 << 24), "layers": [
            {"kind": "flatten"}, {"kind": "linear", "out": 2}]}),
        expect![[r#"
            error: layer 0: flattening [16777216, 16777216, 16777216] gives more than 16777216 features
        "#]],
    );
    // Every dimension in range, but the kernel tensor is 2^24 · 2^24 · 3 · 3 elements.
    check(
        serde_json::json!({"input": image(1 << 24, 3), "layers": [
            {"kind": "conv2d", "out_channels": 1 << 24, "kernel": 3},
            {"kind": "flatten"}, {"kind": "linear", "out": 2}]}),
        expect![[r#"
            error: layer 0: parameter layers.0.Conv2d.weight [16777216, 16777216, 3, 3] has more than 2147483648 elements
        "#]],
    );
    check(
        serde_json::json!({"input": {"kind": "features", "size": 1 << 20}, "layers": [
            {"kind": "linear", "out": 1 << 11}, {"kind": "linear", "out": 2}]}),
        expect![[r#"
            error: layer 0: the model has 2147489794 parameters, more than 2147483648
        "#]],
    );
}

/// Any spec at all, however large its sizes: inference never panics, and an accepted spec's
/// schema has exactly the sizes exact (u128) arithmetic gives, within the element limit.
mod random_specs {
    use proptest::prelude::*;

    use super::*;

    fn size() -> impl Strategy<Value = u64> {
        prop_oneof![1u64..40, 0u64..=u64::MAX, Just(1 << 24), Just((1 << 24) + 1), Just(0)]
    }

    fn layer() -> impl Strategy<Value = LayerSpec> {
        prop_oneof![
            size().prop_map(|out| LayerSpec::Linear { out }),
            (size(), size(), prop_oneof![0u64..4, 0u64..=u64::MAX]).prop_map(
                |(out_channels, kernel, padding)| LayerSpec::Conv2d {
                    out_channels,
                    kernel,
                    padding
                }
            ),
            size().prop_map(|kernel| LayerSpec::MaxPool2d { kernel }),
            Just(LayerSpec::Relu {}),
            Just(LayerSpec::Flatten {}),
            size().prop_map(|dim| LayerSpec::Embedding { dim }),
            size().prop_map(|hidden| LayerSpec::Lstm { hidden }),
            size().prop_map(|hidden| LayerSpec::Gru { hidden }),
            Just(LayerSpec::LayerNorm {}),
            Just(LayerSpec::LastStep {}),
            Just(LayerSpec::PositionEmbedding {}),
            (size(), size(), size()).prop_map(|(heads, width, ffn)| LayerSpec::TransformerBlock {
                heads,
                width,
                ffn,
                dropout: 0.0,
                activation: Default::default(),
            }),
        ]
    }

    fn input() -> impl Strategy<Value = InputSpec> {
        prop_oneof![
            (size(), size(), size()).prop_map(|(channels, height, width)| InputSpec::Image {
                channels,
                height,
                width
            }),
            size().prop_map(|size| InputSpec::Features { size }),
            (size(), size()).prop_map(|(vocab, length)| InputSpec::Tokens { vocab, length }),
        ]
    }

    proptest! {
        #[test]
        fn inference_never_overflows(input in input(), layers in proptest::collection::vec(layer(), 1..6)) {
            let spec = ModelSpec { input, layers, lora: None };
            if let Ok(schema) = spec.schema() {
                schema.validate().unwrap();
                let mut total: u128 = 0;
                for t in &schema.tensors {
                    let exact: u128 = t.shape.iter().map(|&d| u128::from(d)).product();
                    prop_assert_eq!(u128::from(t.numel()), exact);
                    total += exact;
                }
                prop_assert!(total <= u128::from(MAX_SCHEMA_ELEMENTS));
                prop_assert_eq!(u128::from(schema.numel()), total);
            }
        }
    }
}

fn lora_transformer(lora: serde_json::Value) -> serde_json::Value {
    serde_json::json!({"input": {"kind": "tokens", "vocab": 10, "length": 4}, "layers": [
        {"kind": "embedding", "dim": 4},
        {"kind": "transformer_block", "heads": 2, "width": 4, "ffn": 8},
        {"kind": "last_step"}, {"kind": "linear", "out": 10}], "lora": lora})
}

#[test]
fn lora_adds_two_tensors_after_each_targeted_linear_map() {
    let lora = serde_json::json!({"rank": 2, "alpha": 4.0, "targets": ["*.query", "*.value", "layers.3.Linear"]});
    check(
        lora_transformer(lora),
        expect![[r#"
            layers.0.Embedding.weight [10, 4]
            layers.1.TransformerBlock.norm_attention.gamma [4]
            layers.1.TransformerBlock.norm_attention.beta [4]
            layers.1.TransformerBlock.query.weight [4, 4]
            layers.1.TransformerBlock.query.bias [4]
            layers.1.TransformerBlock.query.lora_a [4, 2]
            layers.1.TransformerBlock.query.lora_b [2, 4]
            layers.1.TransformerBlock.key.weight [4, 4]
            layers.1.TransformerBlock.key.bias [4]
            layers.1.TransformerBlock.value.weight [4, 4]
            layers.1.TransformerBlock.value.bias [4]
            layers.1.TransformerBlock.value.lora_a [4, 2]
            layers.1.TransformerBlock.value.lora_b [2, 4]
            layers.1.TransformerBlock.output.weight [4, 4]
            layers.1.TransformerBlock.output.bias [4]
            layers.1.TransformerBlock.norm_ffn.gamma [4]
            layers.1.TransformerBlock.norm_ffn.beta [4]
            layers.1.TransformerBlock.ffn_inner.weight [4, 8]
            layers.1.TransformerBlock.ffn_inner.bias [8]
            layers.1.TransformerBlock.ffn_outer.weight [8, 4]
            layers.1.TransformerBlock.ffn_outer.bias [4]
            layers.3.Linear.weight [4, 10]
            layers.3.Linear.bias [10]
            layers.3.Linear.lora_a [4, 2]
            layers.3.Linear.lora_b [2, 10]
        "#]],
    );
}

#[test]
fn bad_lora_sections_are_refused_by_name() {
    for (lora, expect) in [
        (
            serde_json::json!({"rank": 2, "alpha": 4.0, "targets": ["*.qeury"]}),
            expect![[r#"
                error: lora: target "*.qeury" matches no linear map (they are: layers.1.TransformerBlock.query, layers.1.TransformerBlock.key, layers.1.TransformerBlock.value, layers.1.TransformerBlock.output, layers.1.TransformerBlock.ffn_inner, layers.1.TransformerBlock.ffn_outer, layers.3.Linear)
            "#]],
        ),
        (
            serde_json::json!({"rank": 0, "alpha": 4.0, "targets": ["*.query"]}),
            expect![[r#"
            error: lora: rank must be in 1..=16777216
        "#]],
        ),
        (
            serde_json::json!({"rank": 2, "alpha": 0.0, "targets": ["*.query"]}),
            expect![[r#"
            error: lora: alpha must be positive and finite
        "#]],
        ),
        (
            serde_json::json!({"rank": 2, "alpha": 1.0, "targets": []}),
            expect![[r#"
            error: lora: targets must list 1..=256 patterns
        "#]],
        ),
    ] {
        check(lora_transformer(lora), expect);
    }
}

/// The merged model is `W + (alpha / rank)·A·B` for each adapted weight, computed here by
/// definition (row by column, in f64), and every other tensor as it was; its length is the base
/// spec's.
#[test]
fn merging_lora_adds_the_scaled_low_rank_product_to_each_adapted_weight() {
    let spec: ModelSpec = serde_json::from_value(lora_transformer(
        serde_json::json!({"rank": 2, "alpha": 3.0, "targets": ["*.query", "layers.3.Linear"]}),
    ))
    .unwrap();
    let schema = spec.schema().unwrap();
    let values: Vec<f32> =
        (0..schema.numel()).map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0).collect();
    let merged = spec.merge_lora(&values).unwrap();
    let base = spec.without_lora();
    assert_eq!(merged.len() as u64, base.schema().unwrap().numel());
    // Each tensor's values by name, in the adapted model and in the merged one.
    let by_name = |schema: &TensorSchema, values: &[f32]| {
        let mut out = std::collections::BTreeMap::new();
        let mut offset = 0;
        for t in &schema.tensors {
            let n = t.numel() as usize;
            out.insert(t.name.clone(), (t.shape.clone(), values[offset..offset + n].to_vec()));
            offset += n;
        }
        out
    };
    let adapted = by_name(&schema, &values);
    let merged = by_name(&base.schema().unwrap(), &merged);
    for (name, (shape, got)) in &merged {
        let path = name.strip_suffix(".weight");
        match path.and_then(|p| adapted.get(&format!("{p}.lora_a")).map(|a| (p, a))) {
            Some((path, (_, a))) => {
                let (_, b) = &adapted[&format!("{path}.lora_b")];
                let (_, w) = &adapted[name];
                let (rows, cols) = (shape[0] as usize, shape[1] as usize);
                for r in 0..rows {
                    for c in 0..cols {
                        let ab: f64 = (0..2)
                            .map(|k| f64::from(a[r * 2 + k]) * f64::from(b[k * cols + c]))
                            .sum();
                        let want = f64::from(w[r * cols + c]) + 1.5 * ab;
                        assert!((f64::from(got[r * cols + c]) - want).abs() < 1e-6, "{name}");
                    }
                }
            }
            None => assert_eq!(got, &adapted[name].1, "{name} is not adapted"),
        }
    }
    assert!(merged.keys().all(|n| !n.contains("lora")));
}

//! The spec's schema and the built module agree, both ways, for every layer kind.

use burn::tensor::Device;
use starling_core::model_spec::ModelSpec;

use super::*;

fn spec(json: serde_json::Value) -> ModelSpec {
    serde_json::from_value(json).unwrap()
}

fn cnn() -> ModelSpec {
    spec(
        serde_json::json!({"input": {"kind": "image", "channels": 1, "height": 12, "width": 12}, "layers": [
            {"kind": "conv2d", "out_channels": 4, "kernel": 3, "padding": 1}, {"kind": "relu"}, {"kind": "max_pool2d", "kernel": 2},
            {"kind": "flatten"}, {"kind": "dropout", "prob": 0.1}, {"kind": "linear", "out": 16}, {"kind": "layer_norm"},
            {"kind": "relu"}, {"kind": "linear", "out": 10}
        ]}),
    )
}

fn recurrent() -> ModelSpec {
    spec(serde_json::json!({"input": {"kind": "tokens", "vocab": 20, "length": 6}, "layers": [
        {"kind": "embedding", "dim": 5}, {"kind": "lstm", "hidden": 7}, {"kind": "gru", "hidden": 6},
        {"kind": "layer_norm"}, {"kind": "last_step"}, {"kind": "linear", "out": 20}
    ]}))
}

#[test]
fn module_schema_equals_spec_schema() {
    for spec in [cnn(), recurrent()] {
        let model = SpecModel::build(&spec, &Device::flex()).unwrap();
        assert_eq!(model.schema(), spec.schema().unwrap());
    }
}

#[test]
fn coordinator_parameters_round_trip_through_the_module() {
    for spec in [cnn(), recurrent()] {
        let values = spec.initial_parameters(3).unwrap();
        let model = SpecModel::build(&spec, &Device::flex().autodiff())
            .unwrap()
            .load_parameters(&values)
            .unwrap();
        assert_eq!(model.parameters(), values);
        let err = SpecModel::build(&spec, &Device::flex())
            .unwrap()
            .load_parameters(&values[1..])
            .unwrap_err();
        assert_eq!(
            err,
            ModelError::ParameterCount { expected: values.len(), got: values.len() - 1 }
        );
    }
}

#[test]
fn forward_gives_logits_of_the_spec_shape() {
    let device = Device::flex();
    let model = SpecModel::build(&cnn(), &device).unwrap();
    let images = Tensor::<4>::zeros([3, 1, 12, 12], &device);
    assert_eq!(model.forward(Batch::Image(images)).dims(), [3, 10]);
    let model = SpecModel::build(&recurrent(), &device).unwrap();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(vec![1i64; 12], [2, 6]), &device);
    assert_eq!(model.forward(Batch::Tokens(tokens)).dims(), [2, 20]);
}

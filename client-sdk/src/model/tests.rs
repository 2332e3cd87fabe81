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

fn transformer() -> ModelSpec {
    spec(serde_json::json!({"input": {"kind": "tokens", "vocab": 20, "length": 6}, "layers": [
        {"kind": "embedding", "dim": 8}, {"kind": "position_embedding"},
        {"kind": "transformer_block", "heads": 2, "width": 8, "ffn": 16, "dropout": 0.1},
        {"kind": "transformer_block", "heads": 4, "width": 8, "ffn": 12},
        {"kind": "layer_norm"}, {"kind": "last_step"}, {"kind": "linear", "out": 20}
    ]}))
}

/// Llama's shape: RMS norms, rotary positions, grouped-query attention (4 query heads over 2
/// key/value heads, then plain multi-head), SwiGLU; a GPT-2 block (GELU's tanh form) between,
/// and adapters on a Llama block's maps.
fn llama() -> ModelSpec {
    spec(serde_json::json!({"input": {"kind": "tokens", "vocab": 20, "length": 6}, "layers": [
        {"kind": "embedding", "dim": 8},
        {"kind": "llama_block", "heads": 4, "kv_heads": 2, "width": 8, "ffn": 12, "rope_theta": 500.0},
        {"kind": "transformer_block", "heads": 2, "width": 8, "ffn": 16, "activation": "gelu_tanh"},
        {"kind": "llama_block", "heads": 2, "kv_heads": 2, "width": 8, "ffn": 10, "norm_eps": 1e-5},
        {"kind": "rms_norm", "eps": 1e-5}, {"kind": "last_step"}, {"kind": "linear", "out": 20}
    ], "lora": {"rank": 2, "alpha": 4.0, "targets": ["layers.3.LlamaBlock.*"]}}))
}

/// The transformer with adapters on its attention's query and value maps and on its output
/// layer.
fn lora_transformer() -> ModelSpec {
    let mut spec = transformer();
    spec.lora = Some(
        serde_json::from_value(serde_json::json!({
            "rank": 2, "alpha": 6.0, "targets": ["*.query", "*.value", "layers.6.Linear"]
        }))
        .unwrap(),
    );
    spec
}

#[test]
fn module_schema_equals_spec_schema() {
    for spec in [cnn(), recurrent(), transformer(), lora_transformer(), llama()] {
        let model = SpecModel::build(&spec, &Device::flex()).unwrap();
        assert_eq!(model.schema(), spec.schema().unwrap());
    }
}

#[test]
fn coordinator_parameters_round_trip_through_the_module() {
    for spec in [cnn(), recurrent(), transformer(), lora_transformer(), llama()] {
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
    assert_eq!(model.forward(Batch::Tokens(tokens.clone())).dims(), [2, 20]);
    let model = SpecModel::build(&transformer(), &device).unwrap();
    assert_eq!(model.forward(Batch::Tokens(tokens.clone())).dims(), [2, 20]);
    let model = SpecModel::build(&llama(), &device).unwrap();
    assert_eq!(model.forward(Batch::Tokens(tokens)).dims(), [2, 20]);
}

/// The patch multiply (`conv2d`) against burn's own convolution: the same outputs and the same
/// weight, bias and input gradients, for one and three input channels, with and without padding,
/// with an input that carries a gradient (a hidden layer) and one that does not (the first).
#[test]
fn a_convolution_by_patch_multiply_equals_burns_convolution() {
    use burn::tensor::Distribution;
    let device = Device::flex().autodiff();
    // The last: the FedAvg CNN's second layer at B = 10, whose patches take three groups.
    for (batch, channels, kernel, padding, tracked, [h, w]) in [
        (4, 1, 5, 2, false, [9, 11]),
        (4, 3, 3, 1, true, [9, 11]),
        (4, 2, 3, 0, true, [9, 11]),
        (4, 4, 5, 2, true, [9, 11]),
        (4, 2, 1, 0, false, [9, 11]),
        (10, 32, 5, 2, true, [14, 14]),
    ] {
        let conv = Conv2dConfig::new([channels, 6], [kernel, kernel])
            .with_padding(PaddingConfig2d::Explicit(padding, padding, padding, padding))
            .init(&device);
        let x =
            Tensor::<4>::random([batch, channels, h, w], Distribution::Normal(0.0, 1.0), &device);
        let run = |f: &dyn Fn(Tensor<4>) -> Tensor<4>| {
            let x = if tracked { x.clone().require_grad() } else { x.clone() };
            let out = f(x.clone());
            let weights = Tensor::<4>::random(out.dims(), Distribution::Normal(0.0, 1.0), &device);
            (out, x, weights)
        };
        let (ours, ours_x, weights) = run(&|x| conv2d(&conv, x));
        let (burns, burns_x, _) = run(&|x| conv.forward(x));
        assert_eq!(ours.dims(), burns.dims());
        let ours_grads = (ours.clone() * weights.clone()).sum().backward();
        let burns_grads = (burns.clone() * weights).sum().backward();
        let close = |a: Vec<f32>, b: Vec<f32>, what: &str| {
            assert_eq!(a.len(), b.len(), "{what}");
            let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
            assert!(worst < 1e-4, "{what}: differs by {worst} ({channels} channels, k {kernel})");
        };
        let values = |t: Tensor<4>| t.into_data().try_to_vec::<f32>().unwrap();
        close(values(ours), values(burns), "output");
        let weight_grad = |g| conv.weight.grad(g).unwrap().into_data().try_to_vec::<f32>().unwrap();
        close(weight_grad(&ours_grads), weight_grad(&burns_grads), "weight gradient");
        let bias = conv.bias.as_ref().unwrap();
        let bias_grad = |g| bias.grad(g).unwrap().into_data().try_to_vec::<f32>().unwrap();
        close(bias_grad(&ours_grads), bias_grad(&burns_grads), "bias gradient");
        if tracked {
            let x_grad = |x: &Tensor<4>, g| values(x.grad(g).unwrap());
            close(x_grad(&ours_x, &ours_grads), x_grad(&burns_x, &burns_grads), "input gradient");
        } else {
            assert!(ours_x.grad(&ours_grads).is_none(), "an untracked input gets no gradient");
        }
    }
}

/// The in-place SGD step equals `param - lr · grad`, and steps a copy where the parameter's
/// values are shared, leaving the other holder's values as they were.
#[test]
fn an_sgd_step_is_in_place_only_where_nothing_else_holds_the_values() {
    use burn::tensor::Distribution;
    let device = Device::flex();
    let param = Tensor::<2>::random([300, 70], Distribution::Normal(0.0, 1.0), &device);
    let grad = Tensor::<2>::random([300, 70], Distribution::Normal(0.0, 1.0), &device);
    let values = |t: &Tensor<2>| t.clone().into_data().try_to_vec::<f32>().unwrap();
    let expected = values(&(param.clone() - grad.clone().mul_scalar(0.05)));
    let before = values(&param);
    let kept = param.clone();
    let stepped = cpu_kernels::sgd_step(param, grad.clone(), 0.05);
    assert_eq!(values(&stepped), expected);
    assert_eq!(values(&kept), before, "a shared parameter was written in place");
    let again = cpu_kernels::sgd_step(stepped, grad.clone(), 0.05);
    let twice = values(&(kept - grad.clone().mul_scalar(0.05) - grad.mul_scalar(0.05)));
    assert_eq!(values(&again), twice);
}

/// The fused 2×2 pool against burn's own `max_pool2d` and `relu`, in both orders and without a
/// ReLU: the same outputs and the same input gradients, on an odd-sized input (the last row is
/// dropped) with ties inside windows (a gradient goes to one input of a tie, as burn's does).
#[test]
fn a_fused_2x2_pool_equals_burns_pool_and_relu() {
    use burn::tensor::Distribution;
    let device = Device::flex().autodiff();
    assert!(cpu_kernels::flex_trains(&device));
    let x = Tensor::<4>::random([3, 4, 7, 6], Distribution::Normal(0.0, 1.0), &device);
    // Rounded to halves, so that many windows hold ties, some at zero.
    let x = (x * 2.0).round() / 2.0;
    let weights = Tensor::<4>::random([3, 4, 3, 3], Distribution::Normal(0.0, 1.0), &device);
    let values = |t: Tensor<4>| t.into_data().try_to_vec::<f32>().unwrap();
    let pool = |t| MaxPool2dConfig::new([2, 2]).init().forward(t);
    let cases: [(bool, &dyn Fn(Tensor<4>) -> Tensor<4>); 3] =
        [(true, &|t| relu(pool(t))), (true, &|t| pool(relu(t))), (false, &|t| pool(t))];
    for (relu_too, burns) in cases {
        let run = |f: &dyn Fn(Tensor<4>) -> Tensor<4>| {
            let x = x.clone().require_grad();
            let out = f(x.clone());
            let grads = (out.clone() * weights.clone()).sum().backward();
            (values(out), values(x.grad(&grads).unwrap()))
        };
        let (ours, ours_grad) = run(&|t| cpu_kernels::max_pool_2x2(t, relu_too));
        let (theirs, theirs_grad) = run(burns);
        assert_eq!(ours, theirs, "output, relu {relu_too}");
        // Ties may send a window's gradient to a different one of its equal inputs: compare
        // each window's gradient sum, and where each is nonzero, the count of inputs it reached.
        let per_window = |g: &[f32]| {
            let mut sums = vec![(0.0f32, 0usize); 3 * 4 * 3 * 3];
            for (i, &v) in g.iter().enumerate() {
                let (plane, y, x) = (i / 42, i % 42 / 6, i % 6);
                if y < 6 {
                    let w = &mut sums[plane * 9 + y / 2 * 3 + x / 2];
                    w.0 += v;
                    w.1 += usize::from(v != 0.0);
                }
            }
            sums
        };
        assert_eq!(per_window(&ours_grad), per_window(&theirs_grad), "gradient, relu {relu_too}");
        assert!(ours_grad.iter().skip(36).step_by(42).all(|&g| g == 0.0), "the dropped row");
        assert!(ours_grad.iter().any(|&g| g != 0.0));
    }
}

/// Changing the last steps of a sequence leaves a block's output at every earlier step as it
/// was (causal attention), and does change it at the changed steps: GPT-2's block and Llama's.
#[test]
fn a_transformer_block_never_attends_to_later_steps() {
    use burn::tensor::Distribution;
    let device = Device::flex();
    let gpt = TransformerBlock::new(2, 8, 16, 0.0, true, &|_| None, &device);
    let llama = LlamaBlock::new(4, 2, 8, 12, 10_000.0, 1e-6, &|_| None, &device);
    let blocks: [&dyn Fn(Tensor<3>) -> Tensor<3>; 2] = [&|x| gpt.forward(x), &|x| llama.forward(x)];
    for block in blocks {
        let x = Tensor::<3>::random([3, 6, 8], Distribution::Normal(0.0, 1.0), &device);
        let later = Tensor::<3>::random([3, 2, 8], Distribution::Normal(0.0, 1.0), &device);
        let changed = Tensor::cat(vec![x.clone().slice([0..3, 0..4, 0..8]), later], 1);
        let (a, b) = (block(x), block(changed));
        let earlier =
            |t: Tensor<3>| t.slice([0..3, 0..4, 0..8]).into_data().try_to_vec::<f32>().unwrap();
        let last =
            |t: Tensor<3>| t.slice([0..3, 4..6, 0..8]).into_data().try_to_vec::<f32>().unwrap();
        assert_eq!(earlier(a.clone()), earlier(b.clone()));
        assert_ne!(last(a), last(b));
    }
}

/// An adapted model computes what core's merge of it computes as a plain model: the SDK's
/// `x·W + b + s·(x·A)·B` and `x·(W + s·A·B) + b` agree, with adapters far from zero.
#[test]
fn an_adapted_model_equals_its_merged_base_model() {
    let device = Device::flex();
    let spec = lora_transformer();
    let values: Vec<f32> = spec
        .initial_parameters(5)
        .unwrap()
        .iter()
        .enumerate()
        // lora_b starts at zero; move every value so the adapters count.
        .map(|(i, v)| v + ((i * 13 % 17) as f32 - 8.0) / 64.0)
        .collect();
    let adapted = SpecModel::build(&spec, &device).unwrap().load_parameters(&values).unwrap();
    let base = spec.without_lora();
    let merged = SpecModel::build(&base, &device)
        .unwrap()
        .load_parameters(&spec.merge_lora(&values).unwrap())
        .unwrap();
    let ids: Vec<i64> = (0..18).map(|i| i * 7 % 20).collect();
    let tokens = || Tensor::<2, Int>::from_data(TensorData::new(ids.clone(), [3, 6]), &device);
    let logits =
        |m: &SpecModel| m.forward(Batch::Tokens(tokens())).into_data().try_to_vec::<f32>().unwrap();
    let (a, m) = (logits(&adapted), logits(&merged));
    let worst = a.iter().zip(&m).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    assert!(worst < 1e-4, "largest difference {worst}");
    // And the adapters matter: the base model without them computes something else.
    let plain = SpecModel::build(&base, &device)
        .unwrap()
        .load_parameters(&strip_adapters(&spec, &values))
        .unwrap();
    let off = a.iter().zip(&logits(&plain)).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    assert!(off > 1e-2, "the adapters change nothing: {off}");
}

/// An adapted model's values without its adapters.
fn strip_adapters(spec: &ModelSpec, values: &[f32]) -> Vec<f32> {
    let mut out = vec![];
    let mut offset = 0;
    for t in &spec.schema().unwrap().tensors {
        let n = t.numel() as usize;
        if !t.name.contains(".lora_") {
            out.extend_from_slice(&values[offset..offset + n]);
        }
        offset += n;
    }
    out
}

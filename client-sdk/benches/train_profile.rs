//! Where a training step of the FedAvg paper's CNN spends its time on the CPU backend: the
//! forward and backward pass of each layer alone, at the shapes training gives it, beside one
//! whole step of the SDK's own training loop. What the layers do not add up to is the time a step
//! loses outside them (batch assembly, the loss read-back, the optimizer, allocation).
//!
//! A layer's backward time is its forward-and-backward time less its forward time; the backward
//! of the first convolution leaves out its input gradient, as training does. Convolutions and
//! linear layers also show the multiply-add rate they reach.
//!
//! Run with `cargo bench -p starling-client --bench train_profile` (add `--profile dev` to
//! reuse the test build).

use std::hint::black_box;
use std::path::PathBuf;
use std::time::Instant;

use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::pool::MaxPool2dConfig;
use burn::nn::{LinearConfig, PaddingConfig2d};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Distribution, Int, Tensor};

use starling_client::data::{Split, mnist};
use starling_client::model::{ModelIo, SpecModel, cpu_kernels};
use starling_client::simulate::{ModelKind, model_spec};
use starling_client::train::{TrainingPlan, train};

/// Timed repetitions per measurement; the best is kept.
const REPEATS: usize = 15;

/// Training frees and allocates megabytes of activations every step; glibc's malloc hands them
/// back to the kernel and faults them in again, mimalloc keeps them (docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    // As training runs: on a rayon pool's threads (`train::train` does the same).
    let pool = rayon::ThreadPoolBuilder::new().build().expect("a thread pool");
    pool.install(profile_both_batches);
}

fn profile_both_batches() {
    let device = Device::flex().autodiff();
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/mnist");
    let examples = match mnist(&dir, Split::Test) {
        Ok(e) => e,
        Err(e) => {
            println!("train_profile skipped: {e}");
            return;
        }
    };
    for batch in [10usize, 64] {
        println!("FedAvg CNN, B = {batch}, flex CPU backend, best of {REPEATS}");
        println!(
            "{:<22} {:>10} {:>10} {:>10} {:>10}",
            "layer", "fwd ms", "bwd ms", "GFLOP/s", "share"
        );
        let rows = layer_rows(batch, &device);
        let step = whole_step_ms(batch, &examples, &device);
        // burn's own layers are shown for comparison; the step runs the SDK's.
        let in_step = |r: &&Row| !r.name.ends_with("(burn)");
        let layers: f64 = rows.iter().filter(in_step).map(|r| r.forward_ms + r.backward_ms).sum();
        for row in &rows {
            let ms = row.forward_ms + row.backward_ms;
            let rate =
                row.flops.map(|f| format!("{:.1}", f / (ms / 1e3) / 1e9)).unwrap_or_default();
            println!(
                "{:<22} {:>10.3} {:>10.3} {:>10} {:>9.0}%",
                row.name,
                row.forward_ms,
                row.backward_ms,
                rate,
                100.0 * ms / step
            );
        }
        println!(
            "{:<22} {:>21.3} {:>21.0}%",
            "outside the layers",
            step - layers,
            100.0 * (step - layers) / step
        );
        println!(
            "{:<22} {:>21.3}   ({:.0} examples/s)",
            "whole step",
            step,
            batch as f64 * 1e3 / step
        );
        println!();
    }
}

struct Row {
    name: &'static str,
    forward_ms: f64,
    backward_ms: f64,
    /// Multiply-add FLOPs of forward and backward, for layers that multiply.
    flops: Option<f64>,
}

/// Each layer alone: its input is a fresh tensor of the shape training gives it. Rows marked
/// "(burn)" are burn's own layers, for comparison, and are not in the step; the others are what
/// the SDK runs on flex (`model::cpu_kernels`).
fn layer_rows(b: usize, device: &Device) -> Vec<Row> {
    let same = PaddingConfig2d::Explicit(2, 2, 2, 2);
    let conv1: Conv2d = Conv2dConfig::new([1, 32], [5, 5]).with_padding(same.clone()).init(device);
    let conv2: Conv2d = Conv2dConfig::new([32, 64], [5, 5]).with_padding(same).init(device);
    let pool = MaxPool2dConfig::new([2, 2]).init();
    let fc1 = LinearConfig::new(3136, 512).init(device);
    let fc2 = LinearConfig::new(512, 10).init(device);
    let loss = CrossEntropyLossConfig::new().init(device);
    let conv_flops = |c: usize, o: usize, hw: usize| (2 * b * o * c * 25 * hw * hw) as f64;
    let fc_flops = |i: usize, o: usize| (2 * b * i * o) as f64;
    let targets =
        Tensor::<1, Int>::from_ints(&(0..b as i32).map(|i| i % 10).collect::<Vec<_>>()[..], device);
    let with_bias = |conv: &Conv2d, x: Tensor<4>| {
        let bias = conv.bias.as_ref().expect("burn's default has a bias").val();
        let channels = bias.dims()[0];
        cpu_kernels::conv2d_by_patches(x, conv.weight.val(), 2) + bias.reshape([1, channels, 1, 1])
    };
    // The first layer's input is data: no gradient flows to it.
    let conv1_flops = Some(2.0 * conv_flops(1, 32, 28));
    let conv2_flops = Some(3.0 * conv_flops(32, 64, 14));
    vec![
        profile("conv1 1→32 5×5 (burn)", [b, 1, 28, 28], false, conv1_flops, device, |x| {
            conv1.forward(x)
        }),
        profile("conv1 1→32 5×5", [b, 1, 28, 28], false, conv1_flops, device, |x| {
            with_bias(&conv1, x)
        }),
        profile("relu1, pool1 (burn)", [b, 32, 28, 28], true, None, device, |x| {
            pool.forward(relu(x))
        }),
        profile("relu1 + pool1 2×2", [b, 32, 28, 28], true, None, device, |x| {
            cpu_kernels::max_pool_2x2(x, true)
        }),
        profile("conv2 32→64 5×5 (burn)", [b, 32, 14, 14], true, conv2_flops, device, |x| {
            conv2.forward(x)
        }),
        profile("conv2 32→64 5×5", [b, 32, 14, 14], true, conv2_flops, device, |x| {
            with_bias(&conv2, x)
        }),
        profile("relu2 + pool2 2×2", [b, 64, 14, 14], true, None, device, |x| {
            cpu_kernels::max_pool_2x2(x, true)
        }),
        profile("fc1 3136→512", [b, 3136], true, Some(3.0 * fc_flops(3136, 512)), device, |x| {
            fc1.forward(x)
        }),
        profile("relu3", [b, 512], true, None, device, relu),
        profile("fc2 512→10", [b, 512], true, Some(3.0 * fc_flops(512, 10)), device, |x| {
            fc2.forward(x)
        }),
        profile_loss(b, device, |x| loss.forward(x, targets.clone())),
    ]
}

/// Best forward time and best forward-and-backward time of `layer` on a random input.
fn profile<const D: usize, const E: usize>(
    name: &'static str,
    shape: [usize; D],
    input_grad: bool,
    flops: Option<f64>,
    device: &Device,
    layer: impl Fn(Tensor<D>) -> Tensor<E>,
) -> Row {
    let input = || {
        let x = Tensor::<D>::random(shape, Distribution::Normal(0.0, 1.0), device);
        if input_grad { x.require_grad() } else { x }
    };
    let out_shape = layer(input()).shape();
    let weights = Tensor::<E>::random(out_shape, Distribution::Normal(0.0, 1.0), device);
    let forward_ms = best_ms(|| {
        let x = input();
        let started = Instant::now();
        black_box(layer(x));
        started.elapsed()
    });
    let both_ms = best_ms(|| {
        let x = input();
        let started = Instant::now();
        let y = layer(x);
        black_box((y * weights.clone()).sum().backward());
        started.elapsed()
    });
    Row { name, forward_ms, backward_ms: (both_ms - forward_ms).max(0.0), flops }
}

/// The cross-entropy loss on random logits, read back as the training loop does.
fn profile_loss(b: usize, device: &Device, loss: impl Fn(Tensor<2>) -> Tensor<1>) -> Row {
    let input =
        || Tensor::<2>::random([b, 10], Distribution::Normal(0.0, 1.0), device).require_grad();
    let forward_ms = best_ms(|| {
        let x = input();
        let started = Instant::now();
        black_box(loss(x).into_scalar::<f32>());
        started.elapsed()
    });
    let both_ms = best_ms(|| {
        let x = input();
        let started = Instant::now();
        let l = loss(x);
        black_box(l.clone().into_scalar::<f32>());
        black_box(l.backward());
        started.elapsed()
    });
    Row {
        name: "cross-entropy",
        forward_ms,
        backward_ms: (both_ms - forward_ms).max(0.0),
        flops: None,
    }
}

/// One step of the SDK's training loop (batch, forward, loss, backward, SGD), in ms: an epoch
/// of 30 batches timed whole, best of three.
fn whole_step_ms(
    batch: usize,
    examples: &starling_client::examples::Examples,
    device: &Device,
) -> f64 {
    let spec = model_spec(ModelKind::Cnn, examples.input());
    let io = ModelIo::of_spec(&spec).expect("built-in specs are valid");
    let steps = 30;
    let subset = examples.subset(&(0..steps * batch).collect::<Vec<_>>());
    let config =
        TrainingPlan { epochs: 1, batch_size: batch as u32, lr: 0.05, ..TrainingPlan::default() };
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let model = SpecModel::build(&spec, device).expect("built-in specs are valid");
        let started = Instant::now();
        black_box(train(model, io, &subset, &config, device, &mut |_| {}).expect("trains"));
        best = best.min(started.elapsed().as_secs_f64() * 1e3 / steps as f64);
    }
    best
}

fn best_ms(mut timed: impl FnMut() -> std::time::Duration) -> f64 {
    black_box(timed());
    (0..REPEATS).map(|_| timed().as_secs_f64() * 1e3).fold(f64::INFINITY, f64::min)
}

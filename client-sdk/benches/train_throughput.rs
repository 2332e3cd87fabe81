//! Local training throughput (examples/s) of the MNIST 2NN (784-200-200-10) and the FedAvg
//! paper's CNN on real MNIST images, on the CPU backend and on wgpu when an adapter exists.
//!
//! The CPU rows end with the ceiling this machine puts on them: the flex backend's matrix
//! multiply measured at 1024³, and what that rate allows for each model's arithmetic (forward
//! and backward multiply-adds per training example, counted from the spec). A model whose
//! examples/s sit far below its ceiling loses time outside the multiplies; one near it can
//! only go faster on a faster multiply (or a GPU).
//!
//! Run with `cargo bench -p starling-client --bench train_throughput` (add `--profile dev` to
//! reuse the test build: dependencies, burn included, are optimized there too). Set
//! `STARLING_BENCH_BACKENDS=cpu` to leave wgpu out; `vs_pytorch.sh` runs it beside PyTorch.

use std::path::PathBuf;
use std::time::Instant;

use burn::tensor::{Device, Distribution, Tensor};
use starling_core::model_spec::{Activation, LayerSpec, ModelSpec};

use starling_client::backend::{self, BackendChoice};
use starling_client::data::{Split, mnist};
use starling_client::model::{ModelIo, SpecModel};
use starling_client::simulate::{ModelKind, model_spec};
use starling_client::train::{TrainingPlan, train};

/// Training frees and allocates megabytes of activations every step; glibc's malloc hands them
/// back to the kernel and faults them in again, mimalloc keeps them (docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/mnist");
    let examples = match mnist(&dir, Split::Test) {
        Ok(e) => e,
        Err(e) => {
            println!("train_throughput skipped: {e}");
            return;
        }
    };
    println!(
        "{:<8} {:<6} {:>6} {:>8} {:>12}",
        "backend", "model", "batch", "examples", "examples/s"
    );
    let mut backends = vec![backend::select(BackendChoice::Cpu).expect("flex is built in")];
    if std::env::var("STARLING_BENCH_BACKENDS").is_ok_and(|b| b == "cpu") {
        println!("wgpu skipped: STARLING_BENCH_BACKENDS=cpu");
    } else {
        match backend::select(BackendChoice::Wgpu) {
            Ok(wgpu) => {
                println!("wgpu adapter: {wgpu}");
                backends.push(wgpu);
            }
            Err(e) => println!("wgpu skipped: {e}"),
        }
    }
    let mut cpu_rates = Vec::new();
    for backend in &backends {
        for (kind, n, batch) in [
            (ModelKind::Mlp, 4000, 10),
            (ModelKind::Mlp, 4000, 64),
            (ModelKind::Cnn, 300, 10),
            (ModelKind::Cnn, 600, 64),
        ] {
            let spec = model_spec(kind, examples.input());
            let subset = examples.subset(&(0..n).collect::<Vec<_>>());
            let device = backend.training_device();
            let io = ModelIo::of_spec(&spec).unwrap();
            let config =
                TrainingPlan { epochs: 1, batch_size: batch, lr: 0.05, ..TrainingPlan::default() };
            // Two warm-up steps (wgpu compiles its shaders on first use), then the timed epoch.
            let warm = subset.subset(&(0..2 * batch as usize).collect::<Vec<_>>());
            let model = SpecModel::build(&spec, &device).unwrap();
            let (model, _) = train(model, io, &warm, &config, &device, &mut |_| {}).unwrap();
            let started = Instant::now();
            let (_, report) = train(model, io, &subset, &config, &device, &mut |_| {}).unwrap();
            let secs = started.elapsed().as_secs_f64();
            if backend.name() == "cpu" {
                cpu_rates.push((kind, batch, report.examples as f64 / secs, training_flops(&spec)));
            }
            println!(
                "{:<8} {:<6} {:>6} {:>8} {:>12.0}",
                backend.name(),
                format!("{kind:?}").to_lowercase(),
                batch,
                report.examples,
                report.examples as f64 / secs
            );
        }
    }
    let gemm = gemm_flops_per_second(&Device::flex(), 1024);
    println!("cpu (flex) matrix multiply at 1024³: {:.1} GFLOP/s", gemm / 1e9);
    for (kind, batch, rate, flops) in cpu_rates {
        println!(
            "cpu {:<4} B={batch:<3} {:>6.1} MFLOP per training example → at most {:>6.0} examples/s at that rate; measured {rate:.0} ({:.0} % of it)",
            format!("{kind:?}").to_lowercase(),
            flops / 1e6,
            gemm / flops,
            100.0 * rate * flops / gemm,
        );
    }
}

/// Multiply-add FLOPs of one training example: the forward pass of every linear and
/// convolution layer, twice that for the backward pass (gradients of weights and inputs),
/// less the first layer's input gradient, which training never computes. Elementwise layers,
/// pooling, the loss and the optimizer step are left out: they are the time a model loses
/// outside the multiplies.
fn training_flops(spec: &ModelSpec) -> f64 {
    let inputs = spec.layer_inputs().expect("built-in specs are valid");
    let mut forward = Vec::new();
    for (layer, input) in spec.layers.iter().zip(&inputs) {
        let flops = match (*layer, *input) {
            (LayerSpec::Linear { out }, Activation::Flat(f)) => 2 * f * out,
            (LayerSpec::Linear { out }, Activation::Sequence(s, f)) => 2 * s * f * out,
            (LayerSpec::Conv2d { out_channels, kernel, padding }, Activation::Image(c, h, w)) => {
                let (ho, wo) = (h + 2 * padding + 1 - kernel, w + 2 * padding + 1 - kernel);
                2 * out_channels * c * kernel * kernel * ho * wo
            }
            _ => 0,
        };
        forward.push(flops as f64);
    }
    let first = forward.iter().copied().find(|&f| f > 0.0).unwrap_or(0.0);
    3.0 * forward.iter().sum::<f64>() - first
}

/// The flex backend's f32 matrix multiply of two `n`×`n` matrices, in FLOP/s (best of five).
fn gemm_flops_per_second(device: &Device, n: usize) -> f64 {
    let a = Tensor::<2>::random([n, n], Distribution::Normal(0.0, 1.0), device);
    let b = Tensor::<2>::random([n, n], Distribution::Normal(0.0, 1.0), device);
    let _ = a.clone().matmul(b.clone()).into_data();
    let best = (0..5)
        .map(|_| {
            let started = Instant::now();
            let _ = a.clone().matmul(b.clone()).into_data();
            started.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    2.0 * (n * n * n) as f64 / best
}

//! Local training throughput (examples/s) of the MNIST 2NN (784-200-200-10) and the FedAvg
//! paper's CNN on real MNIST images, on the CPU backend and on wgpu when an adapter exists.
//!
//! Run with `cargo bench -p starling-client --bench train_throughput` (add `--profile dev` to
//! reuse the test build: dependencies, burn included, are optimized there too).

use std::path::PathBuf;
use std::time::Instant;

use starling_client::backend::{self, BackendChoice};
use starling_client::data::{Split, mnist};
use starling_client::model::{ModelIo, SpecModel};
use starling_client::simulate::{ModelKind, model_spec};
use starling_client::train::{TrainingConfig, train};

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
    match backend::select(BackendChoice::Wgpu) {
        Ok(wgpu) => {
            println!("wgpu adapter: {wgpu}");
            backends.push(wgpu);
        }
        Err(e) => println!("wgpu skipped: {e}"),
    }
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
            let config = TrainingConfig {
                epochs: 1,
                batch_size: batch,
                lr: 0.05,
                ..TrainingConfig::default()
            };
            // Two warm-up steps (wgpu compiles its shaders on first use), then the timed epoch.
            let warm = subset.subset(&(0..2 * batch as usize).collect::<Vec<_>>());
            let model = SpecModel::build(&spec, &device).unwrap();
            let (model, _) = train(model, io, &warm, &config, &device, &mut |_| {}).unwrap();
            let started = Instant::now();
            let (_, report) = train(model, io, &subset, &config, &device, &mut |_| {}).unwrap();
            let secs = started.elapsed().as_secs_f64();
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
}

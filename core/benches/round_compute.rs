//! The coordinator's own compute in one round of a 1M-parameter model, step by step: folding
//! each upload encoding into the accumulator (one at a time, and a cohort's worth together),
//! an upload's body decoded, the mean, central DP noise (exact, beside a float Box–Muller sampler as the anchor), the
//! server step, encoding and hashing the new model, and its download encodings.
//! These are the round's fixed costs: they do not shrink with the upload encoding, so they
//! bound how much faster a compressed round can get. `cargo bench -p starling-core --bench
//! round_compute` (release); `-- N` sets the parameter count (default 1 000 000).

use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use starling_core::codec;
use starling_core::compression::{Compression, ErrorFeedback};
use starling_core::fedavg::{FedAvgAccumulator, ValidatedUpdate, validate_parts};
use starling_core::rng::SplitMix64;
use starling_core::strategy::ServerOptimizer;
use starling_core::tensor::{DType, TensorSchema, TensorSpec};
use starling_core::wire::UploadRequest;

/// Updates a cohort folds per round in the fleet benchmark this mirrors.
const COHORT: usize = 10;

fn main() {
    let n: usize = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(1_000_000);
    let schema = TensorSchema {
        tensors: vec![TensorSpec { name: "w".into(), shape: vec![n as u64], dtype: DType::F32 }],
    };
    let delta: Vec<f32> = (0..n).map(|j| ((j % 201) as f32 - 100.0) * 1e-4).collect();
    println!("{n} parameters, cohort of {COHORT}; median of 15 runs, ms");
    for compression in ["f32", "f16", "int8", "top_k:0.01"] {
        let compression: Compression = compression.parse().expect("a known encoding");
        let updates: Vec<ValidatedUpdate> = (0..COHORT)
            .map(|i| {
                let bytes = compression.encode(
                    &delta,
                    &mut SplitMix64(i as u64),
                    &mut ErrorFeedback::default(),
                );
                validate_parts(&schema, compression, bytes, 32, BTreeMap::new())
                    .expect("a valid update")
            })
            .collect();
        // Into sums already in memory, as every fold of a round after its first.
        let warm = || {
            let mut acc = FedAvgAccumulator::new(n);
            acc.add(&updates[0]);
            acc
        };
        let one = median(|| {
            let mut acc = warm();
            let started = Instant::now();
            acc.add(&updates[1]);
            let elapsed = started.elapsed();
            black_box(acc);
            elapsed
        });
        let cohort = median(|| {
            let mut acc = warm();
            let started = Instant::now();
            acc.add_all(updates.iter().map(|u| (u, 1.0)));
            let elapsed = started.elapsed();
            black_box(acc);
            elapsed
        });
        println!(
            "fold {:<10} one update {:>6.2}   a cohort of {COHORT} together {:>6.2} ({:.2} per update)",
            compression.to_string(),
            ms(one),
            ms(cohort),
            ms(cohort) / COHORT as f64
        );
    }

    let global: Vec<f32> = (0..n).map(|j| (j % 97) as f32 * 1e-3).collect();
    let update = validate_parts(
        &schema,
        Compression::F32,
        starling_core::tensor::f32_to_le_bytes(&delta),
        32,
        BTreeMap::new(),
    )
    .expect("a valid update");
    // An upload's body decoded: through ciborium alone, and with the delta copied out once.
    let body = codec::to_vec(&starling_core::wire::UploadRequest {
        model_version: starling_core::ModelVersion(1),
        example_count: 32,
        metrics: BTreeMap::from([("loss".to_owned(), 0.5)]),
        delta: schema.encode_f32(&delta),
    })
    .expect("an upload encodes");
    let decode_with = |decode: fn(&[u8]) -> Result<UploadRequest, codec::CodecError>| {
        median(|| {
            let started = Instant::now();
            let request = decode(&body).expect("the upload decodes");
            let elapsed = started.elapsed();
            black_box(request);
            elapsed
        })
    };
    println!(
        "f32 upload decoded            {:>6.3}   (ciborium alone {:.3})",
        ms(decode_with(codec::decode_large)),
        ms(decode_with(codec::decode))
    );
    let aggregate = || {
        let mut acc = FedAvgAccumulator::new(n);
        acc.add(&update);
        acc
    };
    let fresh = median(|| {
        let started = Instant::now();
        let mut acc = FedAvgAccumulator::new(n);
        acc.add(&update);
        let elapsed = started.elapsed();
        black_box(acc);
        elapsed
    });
    println!("fresh sums and a first f32 fold {:>6.2}", ms(fresh));
    let finish = median(|| {
        let acc = aggregate();
        let started = Instant::now();
        let mean = acc.finish().expect("a mean");
        let elapsed = started.elapsed();
        black_box(mean);
        elapsed
    });
    println!("mean (finish)                 {:>6.2}", ms(finish));
    let mean = aggregate().finish().expect("a mean");
    let exact = median(|| {
        let mut noise = starling_core::privacy::Gaussian::new([7; 32]);
        let mut values = mean.mean_delta.clone();
        let started = Instant::now();
        for v in &mut values {
            *v = noise.noised(*v, 1e-3).expect("in range");
        }
        let elapsed = started.elapsed();
        black_box(values);
        elapsed
    });
    // The anchor: what a float sampler (Box–Muller on 53-bit uniforms) costs.
    let float = median(|| {
        let mut rng = SplitMix64(7);
        let mut unit = || ((rng.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64;
        let mut values = mean.mean_delta.clone();
        let started = Instant::now();
        for pair in values.chunks_mut(2) {
            let (r, theta) = ((-2.0 * unit().ln()).sqrt(), std::f64::consts::TAU * unit());
            pair[0] += 1e-3 * r * theta.cos();
            if let Some(second) = pair.get_mut(1) {
                *second += 1e-3 * r * theta.sin();
            }
        }
        let elapsed = started.elapsed();
        black_box(values);
        elapsed
    });
    println!(
        "central DP noise, exact       {:>6.2}   (float Box–Muller {:.2})",
        ms(exact),
        ms(float)
    );
    for optimizer in [
        r#"{"kind": "fed_avg"}"#,
        r#"{"kind": "fed_avg_m", "lr": 0.3}"#,
        r#"{"kind": "fed_adam", "lr": 0.01, "tau": 0.001}"#,
    ] {
        let optimizer: ServerOptimizer = serde_json::from_str(optimizer).expect("an optimizer");
        let state = optimizer.initial_state(n);
        let step = median(|| {
            let started = Instant::now();
            let next = optimizer.step(&global, &mean, &state, 1.0).expect("a finite step");
            let elapsed = started.elapsed();
            black_box(next);
            elapsed
        });
        println!("server step {:<17} {:>6.2}", optimizer.name(), ms(step));
    }
    let encode = median(|| {
        let started = Instant::now();
        let payload = schema.encode_f32(&global);
        let hash = payload.content_hash();
        let bytes = codec::to_vec(&payload).expect("a payload encodes");
        let elapsed = started.elapsed();
        black_box((hash, bytes));
        elapsed
    });
    println!("model encoded and hashed      {:>6.2}", ms(encode));
    for download in ["f16", "int8"] {
        let download: Compression = download.parse().expect("a known encoding");
        let encode = median(|| {
            let started = Instant::now();
            let bytes = download.encode_model(&global);
            let elapsed = started.elapsed();
            black_box(bytes);
            elapsed
        });
        println!("model download in {:<11} {:>6.2}", download.to_string(), ms(encode));
    }
}

fn median(mut run: impl FnMut() -> Duration) -> Duration {
    let mut times: Vec<Duration> = (0..15).map(|_| run()).collect();
    times.sort();
    times[times.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

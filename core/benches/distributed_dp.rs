//! What distributed DP adds to a secure round, in memory: a device's encoding (clip, rotation,
//! rounding, discrete Gaussian noise) against the plain weighted quantization, the bytes it
//! masks, and the coordinator's decoding of the unmasked sum (check, inverse rotation) against
//! the plain decoding. The masking itself is SecAgg+'s, measured by the `secagg` bench.
//! `cargo bench -p starling-core --bench distributed_dp` (release).

use std::time::{Duration, Instant};

use starling_core::privacy::DistributedNoise;
use starling_core::privacy::distributed::{NoiseSource, rotation_seed};
use starling_core::secagg::{Quantizer, decode_weighted_mean, encode_weighted};

/// A deterministic delta of `m` values of norm about 2 (clipped to 1 by the encoding).
fn delta(m: usize, device: u32) -> Vec<f32> {
    (0..m)
        .map(|j| (((j as u32).wrapping_mul(2_654_435_761) ^ device) % 1000) as f32 / 1000.0 - 0.5)
        .collect()
}

/// The mean of `runs` timings of `f`.
fn timed(runs: u32, mut f: impl FnMut()) -> Duration {
    let started = Instant::now();
    for _ in 0..runs {
        f();
    }
    started.elapsed() / runs
}

fn main() {
    println!(
        "| n | m | padded | plain encode | distributed encode | plain decode | distributed decode | plain bytes | distributed bytes |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for (n, m) in [(100u32, 100_000usize), (500, 100_000)] {
        let noise = DistributedNoise::for_plan(1.0, 1.0, m, n, n * 9 / 10).expect("sizes fit");
        let rotation = rotation_seed(&[3; 16]);
        let q = Quantizer::for_cohort(1.0, n);
        let d = delta(m, 1);
        let mut seed = 0u8;
        let distributed_encode = timed(5, || {
            seed = seed.wrapping_add(1);
            std::hint::black_box(noise.encode(&d, &rotation, &mut NoiseSource::new([seed; 32])));
        });
        let plain_encode = timed(5, || {
            std::hint::black_box(encode_weighted(&q, &d, 1, 1));
        });
        // A sum of n contributions (the same one n times: the decoding's cost does not care).
        let one = noise.encode(&d, &rotation, &mut NoiseSource::new([9; 32]));
        let sum: Vec<u32> = one.iter().map(|v| v.wrapping_mul(n)).collect();
        let distributed_decode = timed(5, || {
            let _ = std::hint::black_box(noise.check_sum(&sum, n));
            std::hint::black_box(noise.decode_sum(&sum, &rotation));
        });
        let plain = encode_weighted(&q, &d, 1, 1);
        let plain_sum: Vec<u32> = plain.iter().map(|v| v.wrapping_mul(n)).collect();
        let plain_decode = timed(5, || {
            std::hint::black_box(decode_weighted_mean(&q, &plain_sum, n));
        });
        let ms = |t: Duration| format!("{:.1} ms", t.as_secs_f64() * 1e3);
        println!(
            "| {n} | {m} | {} | {} | {} | {} | {} | {:.1} KiB | {:.1} KiB |",
            noise.padded_len(),
            ms(plain_encode),
            ms(distributed_encode),
            ms(plain_decode),
            ms(distributed_decode),
            (plain.len() * 4) as f64 / 1024.0,
            (one.len() * 4) as f64 / 1024.0,
        );
    }
}

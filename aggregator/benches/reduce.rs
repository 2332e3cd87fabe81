//! Reduction throughput: the CPU engine (threads × batch) against `memcpy` on this machine and
//! against core's unbatched single-thread fold (what the coordinator does alone); the CUDA
//! engine end to end (host → device → sums) and its kernel alone against the card's memory
//! bandwidth; host-to-device copies; an NCCL all-reduce. GPU parts say so and skip without one.
//!
//! `cargo bench -p starling-aggregator --bench reduce` (STARLING_BENCH_PARAMS sets the model
//! size, default 4 Mi parameters = 16 MiB per update).

use std::sync::Arc;
use std::time::Instant;

use starling_aggregator::engine::available_threads;
use starling_aggregator::gpu::{self, CudaReducer};
use starling_aggregator::reduce::{CpuReducer, Reducer};
use starling_core::fedavg::fold_weighted;

fn main() {
    let n: usize =
        std::env::var("STARLING_BENCH_PARAMS").ok().and_then(|v| v.parse().ok()).unwrap_or(4 << 20);
    let count = 32;
    let bytes_per_update = n * 4;
    let updates: Vec<(u64, Arc<Vec<u8>>)> = (0..count)
        .map(|k| {
            let bytes = (0..n)
                .flat_map(|i| (((i * 31 + k * 17) % 129) as f32 / 64.0 - 1.0).to_le_bytes())
                .collect();
            (10 + k as u64, Arc::new(bytes))
        })
        .collect();
    let total = (count * bytes_per_update) as f64;
    println!(
        "model: {n} parameters ({:.1} MiB per update), {count} updates, {} threads available",
        bytes_per_update as f64 / (1 << 20) as f64,
        available_threads()
    );

    // memcpy: copy each update into one destination (read + write of the update's bytes).
    let mut dst = vec![0u8; bytes_per_update];
    let started = Instant::now();
    for (_, d) in &updates {
        dst.copy_from_slice(d);
        std::hint::black_box(&mut dst);
    }
    let memcpy = total / started.elapsed().as_secs_f64() / 1e9;
    println!("memcpy (one thread)                          {memcpy:7.2} GB/s of update bytes");

    // Core's fold, one update at a time, one thread: what the coordinator runs by itself.
    let (mut hi, mut lo) = (vec![0.0; n], vec![0.0; n]);
    let started = Instant::now();
    for (w, d) in &updates {
        fold_weighted(&mut hi, &mut lo, *w, d);
    }
    let unbatched = total / started.elapsed().as_secs_f64() / 1e9;
    println!("core fold_weighted, unbatched, 1 thread      {unbatched:7.2} GB/s");
    let reference = (hi, lo);

    for threads in [1, available_threads()] {
        for batch in [1, 8] {
            let mut r = CpuReducer::new(n, batch, threads);
            let started = Instant::now();
            for (w, d) in &updates {
                r.push(*w, d.clone()).unwrap();
            }
            let sums = r.finish().unwrap();
            let gbps = total / started.elapsed().as_secs_f64() / 1e9;
            assert!(sums == reference, "the CPU engine must equal core's fold");
            println!(
                "CPU engine, {threads} thread(s), batch {batch:2}          {gbps:7.2} GB/s ({:.0} % of memcpy)",
                100.0 * gbps / memcpy
            );
        }
    }

    match gpu::probe() {
        Err(e) => println!("GPU: SKIPPED ({e})"),
        Ok(info) => {
            println!(
                "GPU: {} ({:.0} GiB)",
                info.name,
                info.memory_bytes as f64 / (1u64 << 30) as f64
            );
            let mut r = CudaReducer::new(0, n, 8).unwrap();
            // Warm-up round (JIT, pinned pages).
            for (w, d) in updates.iter().take(8) {
                r.push(*w, d.clone()).unwrap();
            }
            r.finish().unwrap();
            let started = Instant::now();
            for (w, d) in &updates {
                r.push(*w, d.clone()).unwrap();
            }
            let sums = r.finish().unwrap();
            let gbps = total / started.elapsed().as_secs_f64() / 1e9;
            let same = sums.0.iter().zip(&reference.0).all(|(a, b)| a.to_bits() == b.to_bits())
                && sums.1.iter().zip(&reference.1).all(|(a, b)| a.to_bits() == b.to_bits());
            println!(
                "CUDA engine end to end (stage, H2D, kernel)  {gbps:7.2} GB/s; bit-identical to the CPU: {same}"
            );
            let k = gpu::measure_kernel(n, 8, 50).unwrap();
            println!(
                "CUDA kernel alone, batch 8                   {:7.1} GB/s of updates, {:7.1} GB/s of memory traffic",
                k.update_gbps, k.memory_gbps
            );
            println!("pinned host-to-device copy                   {:7.1} GB/s", k.h2d_gbps);
            if gpu::nccl_present() {
                match gpu::measure_all_reduce(n, 20) {
                    Ok(f) => println!(
                        "NCCL all-reduce, {} GPU(s), {:.0} MiB f64     {:7.1} GB/s algorithm bandwidth, {:7.1} GB/s bus bandwidth",
                        f.gpus,
                        (n * 8) as f64 / (1 << 20) as f64,
                        f.algorithm_gbps,
                        f.bus_gbps
                    ),
                    Err(e) => println!("NCCL all-reduce: failed: {e}"),
                }
            } else {
                println!("NCCL: SKIPPED (no libnccl.so on the loader path)");
            }
        }
    }
}

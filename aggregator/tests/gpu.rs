//! The CUDA engine against the CPU engine, bit for bit, and an NCCL group; on a machine
//! without a GPU (CI) each test says it skipped, and the clean errors are checked instead.

use std::sync::Arc;

use starling_aggregator::gpu::{self, CudaReducer, GpuError, NcclGroup};
use starling_aggregator::reduce::{CpuReducer, Reducer};
use starling_core::rng::SplitMix64;
use starling_core::tensor::f32_to_le_bytes;

fn updates(n: usize, count: usize, seed: u64) -> Vec<(u64, Arc<Vec<u8>>)> {
    let mut rng = SplitMix64(seed);
    (0..count)
        .map(|k| {
            let delta: Vec<f32> = (0..n).map(|_| (rng.unit() as f32 - 0.5) * 0.37).collect();
            (1 + (k as u64 * 7919) % 5000, Arc::new(f32_to_le_bytes(&delta)))
        })
        .collect()
}

fn gpu_or_skip(test: &str) -> bool {
    match gpu::probe() {
        Ok(info) => {
            eprintln!(
                "{test}: running on {} (sm_{}{})",
                info.name, info.compute_capability.0, info.compute_capability.1
            );
            true
        }
        Err(e) => {
            starling_core::skipped::skipped(test, &format!("no GPU: {e}"));
            false
        }
    }
}

#[test]
fn without_a_gpu_the_cuda_engine_fails_cleanly() {
    if gpu::probe().is_ok() {
        starling_core::skipped::skipped(
            "without_a_gpu_the_cuda_engine_fails_cleanly",
            "a GPU is present",
        );
        return;
    }
    // A specific error, never a panic.
    let err = CudaReducer::new(0, 1000, 4).err().expect("no GPU, no reducer");
    assert!(matches!(err, GpuError::NoDriver | GpuError::NoDevice), "{err}");
    assert!(err.to_string().contains("CUDA") || err.to_string().contains("GPU"), "{err}");
    if !gpu::nccl_present() {
        assert!(matches!(NcclGroup::unique_id(), Err(GpuError::NoNccl)));
    }
}

#[test]
fn the_cuda_engine_equals_the_cpu_engine_bit_for_bit() {
    if !gpu_or_skip("the_cuda_engine_equals_the_cpu_engine_bit_for_bit") {
        return;
    }
    for (n, count, batch) in [(1usize, 3usize, 2usize), (1000, 17, 4), (300_001, 37, 8)] {
        let ups = updates(n, count, n as u64);
        let mut cpu = CpuReducer::new(n, 8, 4);
        let mut gpu = CudaReducer::new(0, n, batch).unwrap();
        for (w, d) in &ups {
            cpu.push(*w, d.clone()).unwrap();
            gpu.push(*w, d.clone()).unwrap();
        }
        let (ch, cl) = cpu.finish().unwrap();
        let (gh, gl) = gpu.finish().unwrap();
        let same = ch.iter().zip(&gh).all(|(a, b)| a.to_bits() == b.to_bits())
            && cl.iter().zip(&gl).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "n={n}: GPU sums differ from the CPU's");
        // The reducer starts again from zero.
        let (zh, _) = gpu.finish().unwrap();
        assert!(zh.iter().all(|x| *x == 0.0));
    }
}

#[test]
fn an_nccl_group_all_reduces_partial_sums() {
    if !gpu_or_skip("an_nccl_group_all_reduces_partial_sums") {
        return;
    }
    if !gpu::nccl_present() {
        starling_core::skipped::skipped(
            "an_nccl_group_all_reduces_partial_sums",
            "no NCCL library",
        );
        return;
    }
    // One process, one GPU: a group of one (NCCL refuses two ranks on one GPU). The id goes
    // through bytes exactly as it travels through the coordinator, and the sums go through
    // the same call the group's members make.
    let n = 4096;
    let ups = updates(n, 5, 99);
    let mut reducer = CudaReducer::new(0, n, 2).unwrap();
    for (w, d) in &ups {
        reducer.push(*w, d.clone()).unwrap();
    }
    let (hi, lo) = reducer.finish().unwrap();
    let id = NcclGroup::unique_id().unwrap();
    assert_eq!(id.len(), 128);
    let mut group = NcclGroup::join(0, 0, 1, &id).unwrap();
    assert_eq!(group.world_size(), 1);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let (sum_hi, sum_lo) = group.all_reduce_sums(&hi, &lo, true, deadline).unwrap().unwrap();
    let mut cpu = CpuReducer::new(n, 8, 1);
    for (w, d) in &ups {
        cpu.push(*w, d.clone()).unwrap();
    }
    let (cpu_hi, cpu_lo) = cpu.finish().unwrap();
    assert_eq!((sum_hi, sum_lo), (cpu_hi, cpu_lo), "a group of one sums to its own partial");
    assert!(group.all_reduce_sums(&hi, &lo, false, deadline).unwrap().is_none());
    group.abort();
    assert!(matches!(NcclGroup::join(0, 0, 1, &id[..64]), Err(GpuError::BadNcclId(64))));
}

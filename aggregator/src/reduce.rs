//! Reduction engines: fold example-weighted f32 updates into double-double sums, in batches.
//!
//! Both engines compute exactly what [`starling_core::fedavg::fold_weighted`] computes, in the
//! same order for every parameter, so a shard's sums are bit-identical whichever engine (or
//! the coordinator itself) reduced them. What differs is how memory is walked:
//!
//! * [`CpuReducer`]: updates are queued in batches; a batch is reduced tile by tile (a tile of
//!   sums stays in cache while every update of the batch streams through it), with the
//!   parameter range split across threads. The inner loop is core's, which LLVM vectorizes.
//! * `gpu::CudaReducer`: batches are copied host-to-device from pinned memory on one
//!   stream while the previous batch is reduced by a kernel on another.

use std::sync::Arc;

use starling_core::fedavg::fold_weighted;

use crate::error::ReduceError;

/// Double-double sums of a shard: high parts, low parts (accumulated rounding errors).
pub type Sums = (Vec<f64>, Vec<f64>);

/// A reduction engine for one shard of one round.
pub trait Reducer: Send {
    /// What reduces (`"cpu"`, `"cuda"`), for logs and the coordinator's registry.
    fn engine(&self) -> &'static str;
    /// Parameters per update.
    fn n_params(&self) -> usize;
    /// Queues one update (`weight` × little-endian f32 `delta_le`); may reduce a batch now.
    fn push(&mut self, weight: u64, delta_le: Arc<Vec<u8>>) -> Result<(), ReduceError>;
    /// Reduces whatever is queued and returns the sums (high, low parts); the reducer starts
    /// again from zero.
    fn finish(&mut self) -> Result<Sums, ReduceError>;
}

/// Parameters per tile: 16 Ki × (8 + 8) bytes of sums = 256 KiB, an L2's worth.
const TILE: usize = 16 * 1024;
/// Below this many parameters one thread does it all (spawning costs more than it saves).
const PARALLEL_FROM: usize = 4 * TILE;

/// The CPU engine: batched, tiled, multi-threaded.
pub struct CpuReducer {
    hi: Vec<f64>,
    lo: Vec<f64>,
    pending: Vec<(u64, Arc<Vec<u8>>)>,
    batch: usize,
    threads: usize,
}

impl CpuReducer {
    /// An engine for `n_params` parameters that reduces `batch` updates at a time on
    /// `threads` threads.
    pub fn new(n_params: usize, batch: usize, threads: usize) -> Self {
        CpuReducer {
            hi: vec![0.0; n_params],
            lo: vec![0.0; n_params],
            pending: Vec::with_capacity(batch.max(1)),
            batch: batch.max(1),
            threads: threads.max(1),
        }
    }

    fn reduce_pending(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let batch = std::mem::take(&mut self.pending);
        let n = self.hi.len();
        let threads = if n < PARALLEL_FROM { 1 } else { self.threads };
        // Whole tiles per thread, so no two threads touch one cache line.
        let per_thread = n.div_ceil(threads).div_ceil(TILE) * TILE;
        std::thread::scope(|scope| {
            for (part, (hi, lo)) in
                self.hi.chunks_mut(per_thread).zip(self.lo.chunks_mut(per_thread)).enumerate()
            {
                let batch = &batch;
                let mut work = move || {
                    let base = part * per_thread;
                    for (t, (hi, lo)) in hi.chunks_mut(TILE).zip(lo.chunks_mut(TILE)).enumerate() {
                        let start = (base + t * TILE) * 4;
                        let end = start + hi.len() * 4;
                        for (w, delta) in batch {
                            fold_weighted(hi, lo, *w, &delta[start..end]);
                        }
                    }
                };
                if threads == 1 {
                    work();
                } else {
                    scope.spawn(work);
                }
            }
        });
        self.pending = batch;
        self.pending.clear();
    }
}

impl Reducer for CpuReducer {
    fn engine(&self) -> &'static str {
        "cpu"
    }

    fn n_params(&self) -> usize {
        self.hi.len()
    }

    fn push(&mut self, weight: u64, delta_le: Arc<Vec<u8>>) -> Result<(), ReduceError> {
        let expected = self.hi.len() * 4;
        if delta_le.len() != expected {
            return Err(ReduceError::Length { expected, got: delta_le.len() });
        }
        self.pending.push((weight, delta_le));
        if self.pending.len() >= self.batch {
            self.reduce_pending();
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<Sums, ReduceError> {
        self.reduce_pending();
        let n = self.hi.len();
        Ok((
            std::mem::replace(&mut self.hi, vec![0.0; n]),
            std::mem::replace(&mut self.lo, vec![0.0; n]),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use starling_core::fedavg::fold_weighted;
    use starling_core::rng::SplitMix64;
    use starling_core::tensor::f32_to_le_bytes;

    fn updates(n: usize, count: usize) -> Vec<(u64, Arc<Vec<u8>>)> {
        let mut rng = SplitMix64(0x9e37_79b9_7f4a_7c15);
        (0..count)
            .map(|k| {
                let delta: Vec<f32> = (0..n).map(|_| (rng.unit() as f32 - 0.5) * 1e-2).collect();
                (1 + (k as u64 * 31) % 700, Arc::new(f32_to_le_bytes(&delta)))
            })
            .collect()
    }

    #[test]
    fn the_cpu_engine_is_bit_identical_to_core_for_any_batch_and_thread_count() {
        for n in [1, 1000, PARALLEL_FROM + 12_345] {
            let ups = updates(n, 21);
            let (mut hi, mut lo) = (vec![0.0; n], vec![0.0; n]);
            for (w, d) in &ups {
                fold_weighted(&mut hi, &mut lo, *w, d);
            }
            for (batch, threads) in [(1, 1), (8, 2), (5, 3), (32, 4)] {
                let mut r = CpuReducer::new(n, batch, threads);
                for (w, d) in &ups {
                    r.push(*w, d.clone()).unwrap();
                }
                let (h, l) = r.finish().unwrap();
                assert!(h == hi && l == lo, "n={n} batch={batch} threads={threads}");
                // It starts again from zero.
                assert!(r.finish().unwrap().0.iter().all(|x| *x == 0.0));
            }
        }
    }

    #[test]
    fn a_wrong_length_is_refused() {
        let mut r = CpuReducer::new(4, 2, 1);
        assert!(matches!(
            r.push(1, Arc::new(vec![0; 12])),
            Err(ReduceError::Length { expected: 16, got: 12 })
        ));
    }
}

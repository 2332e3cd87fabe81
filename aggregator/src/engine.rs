//! Which reduction engine a node uses: the CUDA engine when a GPU answers, the CPU engine
//! otherwise. The one place that knows both engines.

use crate::error::ReduceError;
use crate::gpu::{CudaReducer, probe};
use crate::reduce::{CpuReducer, Reducer};

/// Which engine an aggregator reduces with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// The CPU engine on this many threads.
    Cpu {
        /// Threads.
        threads: usize,
    },
    /// The CUDA engine on this GPU.
    Cuda {
        /// Device ordinal.
        device: usize,
    },
}

impl Engine {
    /// The CUDA engine on GPU 0 when a CUDA driver and GPU are present, else the CPU engine
    /// on every core.
    pub fn detect() -> Engine {
        match probe() {
            Ok(_) => Engine::Cuda { device: 0 },
            Err(_) => Engine::Cpu { threads: available_threads() },
        }
    }

    /// A reducer of this kind for `n_params` parameters.
    pub fn reducer(&self, n_params: usize) -> Result<Box<dyn Reducer>, ReduceError> {
        Ok(match *self {
            Engine::Cpu { threads } => Box::new(CpuReducer::new(n_params, 8, threads)),
            Engine::Cuda { device } => Box::new(CudaReducer::new(device, n_params, 8)?),
        })
    }

    /// `"cpu"` or `"cuda"`.
    pub fn name(&self) -> &'static str {
        match self {
            Engine::Cpu { .. } => "cpu",
            Engine::Cuda { .. } => "cuda",
        }
    }
}

/// The threads this process may use.
pub fn available_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

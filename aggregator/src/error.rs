//! The aggregator's errors below the service: reductions and the GPU path. A leaf module, so
//! that the engines (`reduce`, `gpu`) and what picks between them (`engine`) depend on it and
//! not on each other.

use cudarc::driver::DriverError;

/// Why a reduction failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReduceError {
    /// An update has another length than the shard's model.
    #[error("update holds {got} bytes, the model {expected}")]
    Length {
        /// Bytes a delta of the model has.
        expected: usize,
        /// Bytes received.
        got: usize,
    },
    /// The GPU path failed.
    #[error(transparent)]
    Gpu(#[from] GpuError),
}

/// Why the GPU path is unavailable or failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// The CUDA driver library (libcuda) is not installed or not on the loader's path.
    #[error(
        "no CUDA driver library (libcuda.so) could be loaded: install the NVIDIA driver or use the CPU engine"
    )]
    NoDriver,
    /// The driver loaded but reports no GPU.
    #[error("the CUDA driver reports no GPU")]
    NoDevice,
    /// The NCCL library is not installed or not on the loader's path.
    #[error(
        "no NCCL library (libnccl.so) could be loaded: install NCCL or put its directory on LD_LIBRARY_PATH"
    )]
    NoNccl,
    /// A CUDA call failed.
    #[error("CUDA error: {0}")]
    Cuda(String),
    /// An NCCL call failed.
    #[error("NCCL error: {0}")]
    Nccl(String),
    /// An NCCL unique id of the wrong size.
    #[error("an NCCL unique id is 128 bytes, got {0}")]
    BadNcclId(usize),
    /// A collective did not finish by its deadline (a member is gone or stalled); the
    /// communicator must be dropped (NCCL abort) and the group joined anew.
    #[error("the NCCL collective did not finish in time")]
    CollectiveTimeout,
}

impl From<DriverError> for GpuError {
    fn from(e: DriverError) -> Self {
        GpuError::Cuda(format!("{e:?}"))
    }
}

impl From<cudarc::nccl::result::NcclError> for GpuError {
    fn from(e: cudarc::nccl::result::NcclError) -> Self {
        GpuError::Nccl(format!("{e:?}"))
    }
}

//! Starling's datacenter aggregator tier: a node that receives the updates of its shard of a
//! large cohort, validates them exactly as the coordinator does (core's code), streams them
//! into a reduction, and reports one partial aggregate per round to the coordinator.
//!
//! * [`reduce`]: the reduction engines (SIMD + multi-threaded CPU; [`gpu`]: CUDA, NCCL);
//!   [`engine`] picks one; [`error`] is their errors.
//! * [`group`]: aggregator groups, whose leader reports one partial for all its members;
//!   [`collective`]: on GPUs, the members' sums meet in an NCCL all-reduce.
//! * [`shard`]: one round's shard: who uploaded, their weights, metrics and sums.
//! * [`service`]: the HTTP service devices upload to, and the loop that polls the coordinator
//!   for shards and reports partials at each round's deadline.
//!
//! No burn here: aggregators work on flat little-endian tensors.

pub mod collective;
pub mod engine;
pub mod error;
pub mod gpu;
pub mod group;
pub mod reduce;
mod report;
pub mod service;
pub mod shard;

pub use engine::Engine;
pub use error::{GpuError, ReduceError};
pub use group::{GroupConfig, GroupConfigError};
pub use reduce::Reducer;
pub use service::{AggregatorConfig, RunningAggregator, TransportSecurity, start};

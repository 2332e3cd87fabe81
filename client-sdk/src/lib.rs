//! Starling's client SDK: what an app embeds to take part in federated training.
//!
//! * [`model`]: a burn module built at run time from the run's declarative model spec, with
//!   flat parameter import/export in the coordinator's schema order.
//! * [`train`]: local training (SGD or Adam, FedProx) and evaluation.
//! * [`examples`]: the on-device example store.
//! * [`data`]: loaders for the shared datasets and federated partitioners.
//!
//! Training runs on burn's runtime [`burn::tensor::Device`]: the pure-Rust flex CPU backend
//! here, wgpu where the `wgpu` feature is enabled and an adapter exists.

pub mod data;
pub mod examples;
pub mod model;
pub mod train;

//! Starling's client SDK: what an app embeds to take part in federated training.
//!
//! * [`model`]: a burn module built at run time from the run's declarative model spec, with
//!   flat parameter import/export in the coordinator's schema order.
//! * [`train`]: local training (SGD or Adam, FedProx) and evaluation; [`trainer`]: the
//!   hand-off to an app's own trainer in another framework.
//! * [`examples`]: the on-device example store.
//! * `data`: loaders for the shared datasets and federated partitioners.
//! * [`protocol`]: fleet and admin API clients; [`participant`]: one device's participation
//!   (check-in → evaluate → train → upload), with saveable state.
//! * `evaluate`: central evaluation of a run's models on a held-out set, reported through the
//!   admin API.
//! * `simulate`: many real participants against a coordinator, as the `simulate` command.
//!   It, `evaluate` and `data` are the `tools` feature (off by default): an app embedding the
//!   SDK builds without them, and without clap, indicatif, flate2 and toml. The binaries
//!   (`src/bin/`: `starling-client` with `simulate`, `evaluate` and `participate` for one
//!   Linux/IoT device training on local files; `starling`, the operator's command line) own
//!   their command lines and need the feature.
//!
//! Training runs on burn's runtime [`burn::tensor::Device`]; [`backend::select`] picks wgpu
//! (the default `wgpu` feature) when an adapter exists, and the pure-Rust flex CPU backend
//! otherwise.

/// The burn the SDK trains with: an app's own module (see [`model::Classifier`]) must use it.
pub use burn;
/// The compute device training runs on (`Device::flex().autodiff()` for the CPU backend).
pub use burn::tensor::Device;

pub mod backend;
#[cfg(feature = "tools")]
pub mod data;
#[cfg(feature = "tools")]
pub mod evaluate;
pub mod examples;
pub mod model;
pub mod participant;
pub mod protocol;
pub mod secure;
#[cfg(feature = "tools")]
pub mod simulate;
pub mod train;
pub mod trainer;

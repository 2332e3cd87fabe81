//! Sans-IO heart of Starling, shared by the coordinator, the client SDK and the aggregator tier.
//!
//! Nothing here opens a socket, reads a clock or touches a database: time comes in as
//! [`Millis`] arguments and effects go out as [`round::Action`] values, so every piece is
//! deterministic and testable without mocks.
//!
//! * [`tensor`]: tensor schemas, their stable `schema_id`, and the little-endian payload codec.
//! * [`codec`]: the CBOR codec; [`wire`]: versioned fleet-API messages; [`admin`]: the admin
//!   API's views.
//! * [`fedavg`]: update validation and the streaming weighted-FedAvg accumulator.
//! * [`model_spec`]: declarative models, their tensor schema and initialization.
//! * [`plan`]: the operator's run plan and its validation.
//! * [`round`]: the round state machine (selection, reporting, closing, commit).
//! * [`secagg`]: SecAgg+ secure aggregation, client and server state machines.
//! * [`tier`]: the aggregator tier: device assignment, upload tickets, partial aggregates.
//! * [`strategy`], [`robust`], [`privacy`]: server optimizers, robust aggregation, differential
//!   privacy and its accountant.
//! * [`rng`]: the reproducible generator for initialization, shuffling and partitioning.

pub mod admin;
pub mod backoff;
pub mod codec;
pub mod compression;
pub mod eligibility;
pub mod fedavg;
#[doc(hidden)]
pub mod fuzzing;
pub mod hf_export;
pub mod hf_import;
pub mod ids;
pub mod model_spec;
pub mod participation;
pub mod plan;
pub mod privacy;
pub mod rng;
pub mod robust;
pub mod round;
pub mod secagg;
#[doc(hidden)]
pub mod skipped;
pub mod strategy;
pub mod tensor;
pub mod tier;
#[cfg(feature = "tokenizers")]
pub mod tokenizer;
pub mod wire;

pub use ids::{AggregatorId, DeviceId, Millis, ModelVersion, RoundIdx, RunId};

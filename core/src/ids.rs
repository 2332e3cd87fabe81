//! Domain identifiers as newtypes, so a round index can never be passed where a run id belongs.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Wall-clock time in milliseconds since the Unix epoch.
///
/// Deadlines are absolute wall-clock instants (not monotonic) because they are persisted and
/// must mean the same thing after a coordinator restart.
pub type Millis = i64;

macro_rules! id_newtype {
    ($(#[$doc:meta])* $name:ident($inner:ty)) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
        #[serde(transparent)]
        pub struct $name(pub $inner);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }
    };
}

id_newtype!(
    /// A training run: one plan, a sequence of rounds, a sequence of model versions.
    RunId(i64)
);
id_newtype!(
    /// The index of a round within its run, counting failed and retried rounds too.
    RoundIdx(i64)
);
id_newtype!(
    /// An enrolled device.
    DeviceId(i64)
);
id_newtype!(
    /// A committed global model within a run; version 0 is the initial model.
    ModelVersion(i64)
);
id_newtype!(
    /// A node of the aggregator tier, numbered by the operator (stable across its restarts).
    AggregatorId(u32)
);

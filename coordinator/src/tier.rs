//! The coordinator's side of the aggregator tier: its settings and the registry of live
//! aggregators, refreshed by their polls and expired when they stop polling.
//!
//! The driver owns the registry; the run machines only ever see the set of live ids
//! ([`starling_core::round::Input::Aggregators`]), and the driver turns an assignment into an
//! [`UploadTarget`] (URL + ticket) when it answers a check-in.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use starling_core::tier::{AggregatorHello, TicketKey, TierConfig, UploadGrant};
use starling_core::wire::UploadTarget;
use starling_core::{AggregatorId, DeviceId, ModelVersion, RoundIdx, RunId};

/// How the tier is configured; absent, no run uses aggregators.
#[derive(Clone)]
pub struct TierSettings {
    /// The secret shared with the aggregators: their bearer credential, and the root of the
    /// upload-ticket key.
    pub secret: String,
    /// Runs selecting more devices per round than this go through the tier.
    pub cohort_threshold: u32,
    /// How long past a round's reporting deadline partials are waited for.
    pub report_grace: Duration,
    /// An aggregator that has not polled for this long counts as lost.
    pub liveness: Duration,
}

impl std::fmt::Debug for TierSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierSettings")
            .field("cohort_threshold", &self.cohort_threshold)
            .field("report_grace", &self.report_grace)
            .field("liveness", &self.liveness)
            .finish_non_exhaustive()
    }
}

impl TierSettings {
    /// What the run machines need to know.
    pub fn config(&self) -> TierConfig {
        TierConfig {
            cohort_threshold: self.cohort_threshold,
            report_grace_ms: self.report_grace.as_millis() as i64,
        }
    }
}

/// Live aggregators, by id.
pub struct AggregatorRegistry {
    settings: TierSettings,
    key: TicketKey,
    nodes: BTreeMap<AggregatorId, Node>,
}

struct Node {
    url: String,
    last_seen: Instant,
}

impl AggregatorRegistry {
    /// An empty registry.
    pub fn new(settings: TierSettings) -> Self {
        let key = TicketKey::derive(settings.secret.as_bytes());
        AggregatorRegistry { settings, key, nodes: BTreeMap::new() }
    }

    /// The settings.
    pub fn settings(&self) -> &TierSettings {
        &self.settings
    }

    /// Records a poll; `true` if the live set changed (a new node, or one back from the dead).
    pub fn seen(&mut self, hello: &AggregatorHello, now: Instant) -> bool {
        let node = Node { url: hello.url.trim_end_matches('/').to_owned(), last_seen: now };
        match self.nodes.insert(hello.id, node) {
            None => {
                tracing::info!(aggregator = %hello.id, url = %hello.url, engine = %hello.engine, "aggregator joined");
                true
            }
            Some(_) => false,
        }
    }

    /// Forgets nodes that stopped polling; `true` if any was forgotten.
    pub fn expire(&mut self, now: Instant) -> bool {
        let liveness = self.settings.liveness;
        let before = self.nodes.len();
        self.nodes.retain(|id, node| {
            let alive = now.duration_since(node.last_seen) < liveness;
            if !alive {
                tracing::warn!(aggregator = %id, "aggregator stopped polling; its devices count as dropped");
            }
            alive
        });
        self.nodes.len() != before
    }

    /// The ids of live aggregators.
    pub fn live(&self) -> Vec<AggregatorId> {
        self.nodes.keys().copied().collect()
    }

    /// Where `device` uploads for this round, with its ticket; `None` if the aggregator was
    /// lost since the assignment (the device will drop out, as it would with that node).
    pub fn target(
        &self,
        run_id: RunId,
        round_idx: RoundIdx,
        model_version: ModelVersion,
        device: DeviceId,
        aggregator: AggregatorId,
    ) -> Option<UploadTarget> {
        let node = self.nodes.get(&aggregator)?;
        let grant = UploadGrant { run_id, round_idx, model_version, device, aggregator };
        Some(UploadTarget { aggregator, url: node.url.clone(), ticket: self.key.ticket(&grant) })
    }
}

//! The aggregator tier's shared pieces: which aggregator a selected device uploads to, the
//! upload tickets that let an aggregator trust a device only the coordinator can authenticate,
//! and the messages between the coordinator and its aggregators.
//!
//! Assignment is rendezvous hashing over the aggregators alive at selection time, so a device
//! keeps its aggregator while that one lives, and losing one moves only its devices.
//! A ticket is an HMAC over (run, round, model version, device, aggregator) under a key both
//! sides derive from the cluster secret: the aggregator checks it without a database.

use std::collections::BTreeMap;

use hmac::{KeyInit, Mac};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::fedavg::{
    MetricsAccumulator, PartialError, PartialSums, ValidatedPartial, check_counts_and_metrics,
    f64s_from_le, f64s_to_le, validate_partial,
};
use crate::ids::{AggregatorId, DeviceId, ModelVersion, RoundIdx, RunId};
use crate::tensor::{SchemaId, TensorSchema};

/// Most aggregators one partial may speak for.
pub const MAX_AGGREGATORS_PER_PARTIAL: usize = 1024;

/// When the coordinator hands a run's devices to the aggregator tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierConfig {
    /// Runs that select more devices per round than this upload through aggregators.
    pub cohort_threshold: u32,
    /// How long after the reporting deadline the coordinator waits for partials.
    pub report_grace_ms: i64,
}

/// The aggregator `device` uploads to, among `live` (rendezvous hashing); `None` if none lives.
pub fn assign(device: DeviceId, live: &[AggregatorId]) -> Option<AggregatorId> {
    live.iter().copied().max_by_key(|a| {
        let mut h = Sha256::new();
        h.update(b"starling-assign-v1");
        h.update(a.0.to_le_bytes());
        h.update(device.0.to_le_bytes());
        let d = h.finalize();
        (u64::from_le_bytes(d[..8].try_into().expect("8 bytes")), a.0)
    })
}

/// What a ticket allows: one device's one upload to one aggregator for one round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UploadGrant {
    /// The run.
    pub run_id: RunId,
    /// The round.
    pub round_idx: RoundIdx,
    /// The model version the update must be computed on.
    pub model_version: ModelVersion,
    /// The device.
    pub device: DeviceId,
    /// The aggregator it uploads to.
    pub aggregator: AggregatorId,
}

/// The key tickets are signed with, derived from the cluster secret.
#[derive(Clone)]
pub struct TicketKey([u8; 32]);

impl std::fmt::Debug for TicketKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TicketKey(..)")
    }
}

type HmacSha256 = hmac::Hmac<Sha256>;

impl TicketKey {
    /// Derives the ticket key from the secret shared by the coordinator and its aggregators.
    pub fn derive(cluster_secret: &[u8]) -> Self {
        let mut key = [0u8; 32];
        hkdf::Hkdf::<Sha256>::new(Some(b"starling-tier-v1"), cluster_secret)
            .expand(b"upload ticket", &mut key)
            .expect("32 bytes is a valid HKDF output length");
        TicketKey(key)
    }

    fn mac(&self, grant: &UploadGrant) -> HmacSha256 {
        let mut mac = HmacSha256::new_from_slice(&self.0).expect("HMAC takes any key length");
        for part in [grant.run_id.0, grant.round_idx.0, grant.model_version.0, grant.device.0] {
            mac.update(&part.to_le_bytes());
        }
        mac.update(&grant.aggregator.0.to_le_bytes());
        mac
    }

    /// The ticket for `grant`, as sent in [`TICKET_HEADER`](crate::wire::TICKET_HEADER).
    pub fn ticket(&self, grant: &UploadGrant) -> String {
        format!("{}:{}", grant.device.0, hex::encode(self.mac(grant).finalize().into_bytes()))
    }

    /// Checks a ticket header for the round and aggregator; the device it names if it is
    /// genuine. Constant-time in the MAC.
    pub fn verify(
        &self,
        header: &str,
        run_id: RunId,
        round_idx: RoundIdx,
        model_version: ModelVersion,
        aggregator: AggregatorId,
    ) -> Option<DeviceId> {
        let (device, mac) = header.split_once(':')?;
        let device = DeviceId(device.parse().ok()?);
        let tag = hex::decode(mac).ok()?;
        let grant = UploadGrant { run_id, round_idx, model_version, device, aggregator };
        self.mac(&grant).verify_slice(&tag).ok()?;
        Some(device)
    }
}

/// `POST /v1/aggregation/poll`: an aggregator says it is alive and asks for its work.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AggregatorHello {
    /// Its id.
    pub id: AggregatorId,
    /// The base URL devices reach it at.
    pub url: String,
    /// What reduces on it (`"cpu"`, `"cuda"`), for operators.
    pub engine: String,
}

/// Longest aggregator-group name (it is a URL path segment).
pub const MAX_GROUP_NAME: usize = 64;

/// What the leader (rank 0) of an aggregator group publishes through the coordinator
/// (`PUT /v1/aggregation/groups/{group}`), so that members find it: where to hand their
/// finished shards, how many members there are, and the NCCL unique id when the group
/// reduces on GPUs.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupRendezvous {
    /// The leader's aggregator id.
    pub leader: AggregatorId,
    /// The leader's base URL (members post their shards there).
    pub leader_url: String,
    /// Members, the leader included.
    pub world_size: u32,
    /// The group's communicator id (128 bytes: NCCL's unique id, or the TCP collective's),
    /// when the group sums by collective.
    #[serde(default, with = "serde_bytes")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>, format = Binary))]
    pub nccl_id: Option<Vec<u8>>,
}

/// Why a group name or rendezvous document is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GroupError {
    /// The name is empty, too long, or not `[A-Za-z0-9._-]`.
    #[error("a group name is 1 to {MAX_GROUP_NAME} characters of A-Z, a-z, 0-9, '.', '_', '-'")]
    BadName,
    /// Fewer than two members, or more than one partial may speak for.
    #[error("a group has 2 to {MAX_AGGREGATORS_PER_PARTIAL} members, not {0}")]
    BadWorldSize(u32),
    /// The leader URL is not http(s).
    #[error("the leader URL must be http:// or https://")]
    BadLeaderUrl,
    /// An NCCL unique id that is not 128 bytes.
    #[error("an NCCL unique id is 128 bytes, got {0}")]
    BadNcclId(usize),
}

/// Checks a group name (it becomes a URL path segment).
pub fn validate_group_name(name: &str) -> Result<(), GroupError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_GROUP_NAME
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok { Ok(()) } else { Err(GroupError::BadName) }
}

impl GroupRendezvous {
    /// Checks the document's fields.
    pub fn validate(&self) -> Result<(), GroupError> {
        if !(2..=MAX_AGGREGATORS_PER_PARTIAL as u32).contains(&self.world_size) {
            return Err(GroupError::BadWorldSize(self.world_size));
        }
        if !crate::wire::is_http_url(&self.leader_url) {
            return Err(GroupError::BadLeaderUrl);
        }
        match &self.nccl_id {
            Some(id) if id.len() != 128 => Err(GroupError::BadNcclId(id.len())),
            _ => Ok(()),
        }
    }
}

/// The answer to [`AggregatorHello`]: the open rounds that have devices assigned to it.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AggregatorWork {
    /// One per open round with devices assigned to the aggregator.
    pub shards: Vec<ShardTask>,
    /// Poll again after this long; the aggregator counts as lost after a few missed polls.
    pub poll_after_ms: u32,
}

/// One round's shard: what an aggregator needs to validate, reduce and report.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardTask {
    /// The run.
    pub run_id: RunId,
    /// The round.
    pub round_idx: RoundIdx,
    /// The model version updates must be computed on.
    pub model_version: ModelVersion,
    /// The schema updates are validated against.
    pub schema: TensorSchema,
    /// Devices assigned to this aggregator so far.
    pub assigned: Vec<DeviceId>,
    /// Whether selection is over (no more devices will be assigned).
    pub selection_over: bool,
    /// Milliseconds until the reporting deadline (relative: aggregators need no synchronized
    /// clock); negative once it passed.
    pub reporting_in_ms: i64,
    /// The run's cap on one device's example count: larger counts weigh this much.
    #[serde(default = "no_example_cap")]
    pub max_examples: u64,
    /// How the run's devices encode their deltas (the plan's `compression`); the aggregator
    /// validates them in it and reduces their decoded values. A coordinator that sends none
    /// means f32.
    #[serde(default, skip_serializing_if = "crate::compression::Compression::is_f32")]
    pub compression: crate::compression::Compression,
}

/// What a coordinator that sends no cap means: only the validation bound.
fn no_example_cap() -> u64 {
    crate::fedavg::MAX_EXAMPLE_COUNT
}

/// `POST /v1/aggregation/runs/{run}/rounds/{round}/partial`: an aggregator's reduced shard.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Clone, PartialEq, Serialize, Deserialize)]
pub struct PartialReport {
    /// The model version the updates were computed on.
    pub model_version: ModelVersion,
    /// The schema the sums are in.
    pub schema_id: SchemaId,
    /// The aggregators whose devices this partial covers (one, or an NCCL group's members).
    pub aggregators: Vec<AggregatorId>,
    /// The devices whose updates are in the sums, each once.
    pub devices: Vec<DeviceId>,
    /// Sum of their example counts.
    pub total_weight: u64,
    /// High parts of the example-weighted sums, little-endian f64.
    #[serde(with = "serde_bytes")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = Binary))]
    pub sum_hi: Vec<u8>,
    /// Low parts, little-endian f64.
    #[serde(with = "serde_bytes")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = Binary))]
    pub sum_lo: Vec<u8>,
    /// Per metric: example-weighted sum and the weight behind it.
    pub metrics: BTreeMap<String, (f64, u64)>,
}

/// Everything but the sums' bytes: reports travel inside traces and logs.
impl std::fmt::Debug for PartialReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartialReport")
            .field("model_version", &self.model_version)
            .field("aggregators", &self.aggregators)
            .field("devices", &self.devices)
            .field("total_weight", &self.total_weight)
            .field("sum_bytes", &(self.sum_hi.len() + self.sum_lo.len()))
            .field("metrics", &self.metrics)
            .finish_non_exhaustive()
    }
}

/// Why a partial report was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PartialReportError {
    /// The report is for another schema than the round's.
    #[error("partial is in another schema than the round's")]
    SchemaMismatch,
    /// The device or aggregator lists are empty, too long or repeat an id.
    #[error("partial's {0} list is empty, too long or repeats an id")]
    BadList(&'static str),
    /// A sums byte string is not a whole number of f64s.
    #[error("partial sums are not whole little-endian f64s")]
    Ragged,
    /// Partials of one group were computed on different model versions.
    #[error("the partials being merged are of different model versions")]
    ModelVersion,
    /// The sums fail validation.
    #[error(transparent)]
    Sums(#[from] PartialError),
}

impl PartialReport {
    /// Packs partial sums for the wire.
    pub fn new(
        model_version: ModelVersion,
        schema_id: SchemaId,
        aggregators: Vec<AggregatorId>,
        devices: Vec<DeviceId>,
        sums: PartialSums,
    ) -> Self {
        PartialReport {
            model_version,
            schema_id,
            aggregators,
            devices,
            total_weight: sums.total_weight,
            sum_hi: f64s_to_le(&sums.hi),
            sum_lo: f64s_to_le(&sums.lo),
            metrics: sums.metrics,
        }
    }

    /// Checks the report against the round's schema; its sums, ready to merge.
    pub fn validate(&self, schema: &TensorSchema) -> Result<ValidatedPartial, PartialReportError> {
        self.check_header(schema)?;
        let (hi, lo) = self.sums()?;
        let sums = PartialSums {
            hi,
            lo,
            total_weight: self.total_weight,
            n_updates: self.devices.len() as u64,
            metrics: self.metrics.clone(),
        };
        Ok(validate_partial(schema, sums)?)
    }

    /// The report without its sums: what a member of a group that sums on its GPUs (NCCL)
    /// tells its leader, the sums going through the collective instead.
    pub fn without_sums(&self) -> PartialReport {
        PartialReport { sum_hi: vec![], sum_lo: vec![], ..self.clone() }
    }

    /// Checks a report whose sums travel apart from it ([`Self::without_sums`]): schema, lists,
    /// counts and metrics as [`Self::validate`] does; the sums must be absent.
    pub fn validate_metadata(&self, schema: &TensorSchema) -> Result<(), PartialReportError> {
        self.check_header(schema)?;
        if !self.sum_hi.is_empty() || !self.sum_lo.is_empty() {
            return Err(PartialReportError::Ragged);
        }
        check_counts_and_metrics(self.total_weight, self.devices.len() as u64, &self.metrics)?;
        Ok(())
    }

    /// The sums (high, low parts) decoded from their little-endian bytes.
    pub fn sums(&self) -> Result<(Vec<f64>, Vec<f64>), PartialReportError> {
        Ok((le_f64s(&self.sum_hi)?, le_f64s(&self.sum_lo)?))
    }

    fn check_header(&self, schema: &TensorSchema) -> Result<(), PartialReportError> {
        if self.schema_id != schema.schema_id() {
            return Err(PartialReportError::SchemaMismatch);
        }
        if !distinct(&self.devices, usize::MAX) {
            return Err(PartialReportError::BadList("device"));
        }
        if !distinct(&self.aggregators, MAX_AGGREGATORS_PER_PARTIAL) {
            return Err(PartialReportError::BadList("aggregator"));
        }
        Ok(())
    }
}

fn le_f64s(bytes: &[u8]) -> Result<Vec<f64>, PartialReportError> {
    f64s_from_le(bytes).ok_or(PartialReportError::Ragged)
}

/// Reports in aggregator-id order (so merges do not depend on arrival order), and the model
/// version they share.
fn in_aggregator_order(
    reports: &[PartialReport],
) -> Result<(ModelVersion, Vec<&PartialReport>), PartialReportError> {
    let mut reports: Vec<&PartialReport> = reports.iter().collect();
    reports.sort_by_key(|r| r.aggregators.first().copied());
    let first = reports.first().ok_or(PartialReportError::BadList("aggregator"))?;
    let model_version = first.model_version;
    if reports.iter().any(|r| r.model_version != model_version) {
        return Err(PartialReportError::ModelVersion);
    }
    Ok((model_version, reports))
}

/// Merges the partial reports of an aggregator group's members into one that speaks for all of
/// them (what the group's leader reports). Reports are merged in aggregator-id order, so the
/// result does not depend on arrival order. Refuses reports of another model version or
/// schema, and an aggregator or device that appears twice.
pub fn merge_reports(
    schema: &TensorSchema,
    reports: &[PartialReport],
) -> Result<PartialReport, PartialReportError> {
    let (model_version, reports) = in_aggregator_order(reports)?;
    let mut aggregators = vec![];
    let mut devices = vec![];
    let mut merged: Option<crate::fedavg::FedAvgAccumulator> = None;
    for report in &reports {
        let sums = report.validate(schema)?;
        aggregators.extend_from_slice(&report.aggregators);
        devices.extend_from_slice(&report.devices);
        match &mut merged {
            None => merged = Some(crate::fedavg::FedAvgAccumulator::from_partial(sums)),
            Some(acc) => acc.merge(&sums),
        }
    }
    let sums = merged.expect("at least one report").into_partial();
    let merged = PartialReport::new(model_version, schema.schema_id(), aggregators, devices, sums);
    // Repeats across reports show up here: the merged lists must be distinct.
    merged.validate(schema)?;
    Ok(merged)
}

/// The report of an aggregator group whose members summed their sums with a collective (NCCL
/// all-reduce on their GPUs) instead of sending them to the leader: the members' reports
/// without sums ([`PartialReport::without_sums`]) merged as [`merge_reports`] merges them,
/// with the collective's `(hi, lo)` as the sums. Refuses what `merge_reports` refuses.
///
/// The collective adds high and low parts separately in f64, so its sums equal the exact
/// (double-double) merge up to the rounding of adding the members' high parts: within
/// (members − 1) × 2⁻⁵³ of the largest member's sum, far below an f32 model's resolution,
/// but not bit for bit.
pub fn merge_collective(
    schema: &TensorSchema,
    reports: &[PartialReport],
    hi: Vec<f64>,
    lo: Vec<f64>,
) -> Result<PartialReport, PartialReportError> {
    let (model_version, reports) = in_aggregator_order(reports)?;
    let mut aggregators = vec![];
    let mut devices = vec![];
    let mut total_weight = 0u64;
    let mut metrics = MetricsAccumulator::default();
    for report in &reports {
        report.validate_metadata(schema)?;
        aggregators.extend_from_slice(&report.aggregators);
        devices.extend_from_slice(&report.devices);
        total_weight = total_weight
            .checked_add(report.total_weight)
            .ok_or(PartialError::Counts("total weight overflows"))?;
        metrics.merge(&report.metrics);
    }
    let sums = PartialSums {
        hi,
        lo,
        total_weight,
        n_updates: devices.len() as u64,
        metrics: metrics.into_sums(),
    };
    let merged = PartialReport::new(model_version, schema.schema_id(), aggregators, devices, sums);
    merged.validate(schema)?;
    Ok(merged)
}

fn distinct<T: Ord>(ids: &[T], max: usize) -> bool {
    if ids.is_empty() || ids.len() > max {
        return false;
    }
    let set: std::collections::BTreeSet<&T> = ids.iter().collect();
    set.len() == ids.len()
}

#[cfg(test)]
mod tests;

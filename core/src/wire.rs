//! Versioned fleet-API messages, shared by the coordinator and every client.
//!
//! Bodies are `application/cbor` ([`crate::codec`]); tensors inside them are [`TensorPayload`]
//! byte strings.
//! Paths are versioned (`/v1/...`); a breaking change to a message adds a `v2` module beside
//! this one rather than editing it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::ids::{DeviceId, Millis, ModelVersion, RoundIdx, RunId};

pub mod path;
use crate::model_spec::ModelSpec;
use crate::secagg;
use crate::tensor::{TensorPayload, TensorSchema};

/// The media type of every fleet-API body.
pub const CBOR_MEDIA_TYPE: &str = "application/cbor";

/// Whether `url` is an `http://` or `https://` URL: the only schemes Starling's coordinator and
/// aggregators are reached by.
pub fn is_http_url(url: &str) -> bool {
    url.starts_with("http://") || url.starts_with("https://")
}

/// Error codes shared by the server and the SDK, so clients can branch on them.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ErrorCode {
    /// The body is not valid CBOR/JSON for the endpoint.
    MalformedBody,
    /// The body exceeds the endpoint's size limit.
    BodyTooLarge,
    /// The tensor payload was encoded for another schema.
    SchemaMismatch,
    /// The tensor payload has the wrong length for the schema.
    ShapeMismatch,
    /// A value is NaN or infinite.
    NonFiniteValue,
    /// A field is out of range (e.g. a zero example count).
    InvalidField,
    /// Missing, unknown, forged or revoked credential.
    Unauthorized,
    /// The run, round or model does not exist.
    NotFound,
    /// The round no longer accepts uploads.
    RoundClosed,
    /// The device was not selected for this round.
    NotSelected,
    /// The device already uploaded in this round.
    DuplicateUpload,
    /// The update was computed on another model version than the round's.
    StaleModel,
    /// The run plan is invalid.
    InvalidPlan,
    /// The run is not in a state that allows the request.
    Conflict,
    /// The store is unavailable; the request may be retried and nothing was acknowledged.
    Unavailable,
    /// An internal error; details are in the server's log.
    Internal,
    /// Too many requests from this device or address; retry after the `Retry-After` header.
    RateLimited,
    /// The request body arrived too slowly; nothing was stored.
    Timeout,
    /// The model version's bytes were given up for good: its run writes a model every
    /// `checkpoint_interval` versions and a later one is written (HTTP 410).
    ModelNotKept,
    /// The device's enrollment token did not name the population it checked in to (HTTP 403).
    PopulationNotAllowed,
    /// The coordinator requires identity keys certified by the operator's enrolment authority,
    /// and the enrolling one is not (HTTP 403).
    IdentityNotCertified,
}

impl ErrorCode {
    /// The snake_case name it travels as (also a metrics label).
    pub fn as_str(&self) -> &'static str {
        match self {
            ErrorCode::MalformedBody => "malformed_body",
            ErrorCode::BodyTooLarge => "body_too_large",
            ErrorCode::SchemaMismatch => "schema_mismatch",
            ErrorCode::ShapeMismatch => "shape_mismatch",
            ErrorCode::NonFiniteValue => "non_finite_value",
            ErrorCode::InvalidField => "invalid_field",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::NotFound => "not_found",
            ErrorCode::RoundClosed => "round_closed",
            ErrorCode::NotSelected => "not_selected",
            ErrorCode::DuplicateUpload => "duplicate_upload",
            ErrorCode::StaleModel => "stale_model",
            ErrorCode::InvalidPlan => "invalid_plan",
            ErrorCode::Conflict => "conflict",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::Internal => "internal",
            ErrorCode::RateLimited => "rate_limited",
            ErrorCode::Timeout => "timeout",
            ErrorCode::ModelNotKept => "model_not_kept",
            ErrorCode::PopulationNotAllowed => "population_not_allowed",
            ErrorCode::IdentityNotCertified => "identity_not_certified",
        }
    }
}

/// Every non-2xx answer carries this body (CBOR on the fleet API, JSON on the admin API).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// Machine-readable cause.
    pub code: ErrorCode,
    /// Human-readable explanation naming the problem.
    pub message: String,
}

/// `POST /v1/enroll`: trade an operator-issued enrollment token for a device credential.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EnrollRequest {
    /// The enrollment token as issued by the operator.
    pub enrollment_token: String,
    /// The device's Ed25519 public key, with which it signs its keys in secure rounds; a device
    /// that enrolls without one takes part in plain runs only.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "identity_key")]
    pub identity_key: Option<[u8; 32]>,
    /// The operator's enrolment authority's certificate of `identity_key`, which a coordinator
    /// configured with that authority requires.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub identity_certificate: Option<secagg::Signature>,
}

/// An Ed25519 public key is exactly 32 bytes: a longer or shorter one (a byte string or an
/// array, as serde writes arrays) is refused by name, not cut or padded to fit.
fn identity_key<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<[u8; 32]>, D::Error> {
    use serde::de::{Error, SeqAccess, Visitor};
    struct Key;
    fn exact<E: Error>(bytes: &[u8]) -> Result<Option<[u8; 32]>, E> {
        <[u8; 32]>::try_from(bytes).map(Some).map_err(|_| {
            E::custom(format!(
                "identity_key: an Ed25519 public key is exactly 32 bytes, not {}",
                bytes.len()
            ))
        })
    }
    impl<'de> Visitor<'de> for Key {
        type Value = Option<[u8; 32]>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("identity_key: an Ed25519 public key of 32 bytes")
        }
        fn visit_none<E: Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_unit<E: Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_any(Key)
        }
        fn visit_bytes<E: Error>(self, v: &[u8]) -> Result<Self::Value, E> {
            exact(v)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            // One past a key's length is enough to refuse it; nothing longer is buffered.
            let mut bytes = Vec::with_capacity(33);
            while bytes.len() <= 32 {
                match seq.next_element::<u8>()? {
                    Some(b) => bytes.push(b),
                    None => break,
                }
            }
            let mut len = bytes.len();
            while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {
                len += 1;
            }
            if len != 32 {
                return Err(A::Error::custom(format!(
                    "identity_key: an Ed25519 public key is exactly 32 bytes, not {len}"
                )));
            }
            exact(&bytes)
        }
    }
    d.deserialize_option(Key)
}

/// Answer to [`EnrollRequest`].
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EnrollResponse {
    /// The new device's id.
    pub device_id: DeviceId,
    /// Bearer credential for every later fleet call; the server keeps only its hash.
    pub credential: String,
}

/// `POST /v1/check-in`: a device offers to participate.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckInRequest {
    /// Population the device belongs to; runs are scheduled per population.
    pub population: String,
    /// The device's conditions, for runs whose plan requires some (`eligibility`).
    #[serde(default)]
    pub attributes: crate::eligibility::DeviceAttributes,
}

/// Answer to [`CheckInRequest`].
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
// One per check-in, moved straight into an encoder: boxing the task would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum CheckInResponse {
    /// The device is selected for a round.
    Task(TaskAssignment),
    /// Pace steering: nothing to do now; check in again after this many seconds.
    ComeBackLater {
        /// Seconds to wait before the next check-in.
        retry_after_secs: u32,
    },
}

/// A round assignment.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskAssignment {
    /// Run the round belongs to.
    pub run_id: RunId,
    /// Round to upload to.
    pub round_idx: RoundIdx,
    /// Version of the global model to train on.
    pub model_version: ModelVersion,
    /// Content hash of that model: `GET /v1/models/{model_hash}`.
    pub model_hash: String,
    /// Schema of the model (and of the expected update, unless `update_schema` says otherwise).
    pub schema: TensorSchema,
    /// Set when the run trains or sends only part of the model: the tensors to upload (the
    /// delta's schema), in model order. The model's other tensors are frozen (not trained)
    /// unless `local_tensors` names them; absent: the whole `schema`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub update_schema: Option<TensorSchema>,
    /// Tensors the device trains and keeps (personalization): never uploaded; the device
    /// trains and evaluates from its own values of them once it has any.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub local_tensors: Vec<String>,
    /// Set when every tensor the run does not train is the imported pretrained model's tensor
    /// of its name (its content hash): fetch that once (`GET /v1/base-models/{hash}`, the same
    /// for every run started from it) and each round only the trained tensors of the model
    /// (`GET /v1/runs/{run}/models/{model_hash}/trained`, in f32).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_model: Option<String>,
    /// Set when the plan names a tokenizer (its content hash, SHA-256 of the file): fetch its
    /// `tokenizer.json` once (`GET /v1/tokenizers/{hash}`) and train on the device's text
    /// tokenized with it, in windows of the spec's input length.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<String>,
    /// The model to build, when the run's plan has a declarative spec.
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    #[serde(default)]
    pub model_spec: Option<ModelSpec>,
    /// The plan's local training configuration, as JSON text, passed through untouched.
    pub training_config: String,
    /// Uploads after this instant are refused.
    pub report_deadline_ms: Millis,
    /// Set when the run aggregates securely: the device does not upload its delta but takes
    /// part in the SecAgg+ stages at `/v1/runs/{run}/rounds/{round}/secagg`.
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    #[serde(default)]
    pub secure_aggregation: Option<SecureAggregationTask>,
    /// Set in an evaluation-only run: evaluate the model on local held-out data and upload
    /// the metrics and example count with an empty delta (schema of no tensors); don't train.
    #[serde(default)]
    pub evaluate_only: bool,
    /// Set when the round goes through the aggregator tier: upload the update there (with
    /// the ticket), not to the coordinator.
    #[serde(default)]
    pub upload_to: Option<UploadTarget>,
    /// The encoding to upload the delta in (the plan's `compression`); absent: f32.
    #[serde(default, skip_serializing_if = "crate::compression::Compression::is_f32")]
    pub compression: crate::compression::Compression,
    /// The encoding to download the model in (the plan's `model_download`): `GET
    /// /v1/models/{model_hash}?compression={it}`; absent: f32, the plain download. Train from
    /// the decoded values and send the delta against them.
    #[serde(default, skip_serializing_if = "crate::compression::Compression::is_f32")]
    pub model_download: crate::compression::Compression,
    /// Set in a differentially private run that withholds its metrics: send no metrics with
    /// the update and report no evaluation (they would be released outside the run's ε);
    /// absent: report them.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub withhold_metrics: bool,
    /// Set in a differentially private run that noises its metrics: send this model version's
    /// evaluation with the update (`eval_accuracy`, `eval_loss` beside `loss`) instead of
    /// reporting it on its own; the coordinator clips and noises them with the cohort's.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub evaluation_in_update: bool,
    /// The plan's requirements on the device's conditions (charging, battery, network, ...),
    /// which the device met when it checked in. The device checks them again with its
    /// conditions of the moment before it trains, and leaves the round when they no longer
    /// hold; absent: none.
    #[serde(default, skip_serializing_if = "crate::eligibility::Eligibility::is_open")]
    pub eligibility: crate::eligibility::Eligibility,
}

/// Where a selected device uploads when its run goes through the aggregator tier.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UploadTarget {
    /// The aggregator.
    pub aggregator: crate::ids::AggregatorId,
    /// Its base URL: the device posts to `{url}/v1/runs/{run}/rounds/{round}/updates`.
    pub url: String,
    /// The value of the [`TICKET_HEADER`] header.
    pub ticket: String,
}

/// The header a device sends its ticket in when it uploads to an aggregator:
/// `{device id}:{hex HMAC}`.
pub const TICKET_HEADER: &str = "x-starling-upload-ticket";

/// What a device needs to take part in a secure-aggregation round.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SecureAggregationTask {
    /// The round's protocol parameters.
    pub config: secagg::Config,
    /// The device's index in the cohort (1-based).
    pub index: secagg::ClientIdx,
    /// Every delta value times its weight is clipped to `[-clip, clip]` before quantization.
    pub clip: f64,
    /// Example counts above this weigh as much as this.
    pub max_examples: u64,
    /// With differential privacy: scale the delta to at most this L2 norm before anything
    /// else (the coordinator noises the unmasked sum for it, unless the noise is distributed).
    #[serde(default)]
    pub clip_norm: Option<f64>,
    /// With distributed DP: encode the delta with this noise (clipped, rotated, rounded to its
    /// grid, discrete Gaussian noise added) instead of the weighted quantization.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub distributed_noise: Option<crate::privacy::DistributedNoise>,
    /// The cap on the evaluation loss in the masked vector; absent:
    /// [`secagg::SECURE_LOSS_CAP`](crate::secagg::SECURE_LOSS_CAP).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evaluation_loss_cap: Option<f64>,
}

impl SecureAggregationTask {
    /// The cap on the evaluation loss in the masked vector.
    pub fn evaluation_loss_cap(&self) -> f64 {
        self.evaluation_loss_cap.unwrap_or(secagg::SECURE_LOSS_CAP)
    }

    /// The quantizer every member of the round uses.
    pub fn quantizer(&self) -> secagg::Quantizer {
        secagg::Quantizer::for_cohort(self.clip, self.config.n)
    }
}

/// `POST /v1/runs/{run}/rounds/{round}/secagg`: a device's message for the current stage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SecAggUpload {
    /// AdvertiseKeys: the device's two public keys, signed with its enrolled identity.
    AdvertiseKeys(secagg::AdvertiseKeys),
    /// ShareKeys: one sealed share message per neighbour, for the server to relay.
    ShareKeys(Vec<secagg::SealedShares>),
    /// MaskedInputCollection: the masked, quantized, weighted delta.
    MaskedInput {
        /// The model version the delta was computed on.
        model_version: ModelVersion,
        /// Ring elements, little-endian `u32`.
        #[serde(with = "serde_bytes")]
        masked: Vec<u8>,
        /// Neighbours whose sealed shares the device could not open (it added no pairwise mask
        /// with them), each with the evidence: the server checks it and leaves them out of the
        /// sum, or refuses the input of a device that accuses without proof.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        accusations: Vec<secagg::Accusation>,
    },
    /// ConsistencyCheck: the device's signature over the survivor set it was shown.
    SignSurvivors(secagg::Signature),
    /// Unmasking: shares that remove masks, never both secrets of one neighbour.
    Unmask(secagg::UnmaskResponse),
}

/// `GET /v1/runs/{run}/rounds/{round}/secagg`: what the device should do next.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SecAggInstruction {
    /// The current stage is still collecting; ask again after this long.
    Wait {
        /// Milliseconds.
        retry_after_ms: u32,
    },
    /// Seal shares of your secrets to these neighbours.
    ShareKeys(secagg::NeighbourKeys),
    /// Open these shares, then send your masked input.
    MaskedInput(secagg::MaskRequest),
    /// Sign this survivor set (once).
    SignSurvivors(secagg::ConsistencyRequest),
    /// Check the survivors' signatures over the set you signed, then send the unmasking shares.
    Unmask(secagg::UnmaskRequest),
    /// Your part is complete.
    Done,
    /// The round goes on without this device (it missed a stage or sent a bad message), or
    /// failed.
    Excluded {
        /// Why.
        reason: String,
    },
}

/// `POST /v1/runs/{run}/rounds/{round}/updates`: a device's update.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UploadRequest {
    /// The model version the delta was computed against.
    pub model_version: ModelVersion,
    /// Number of local examples trained on; the FedAvg weight.
    pub example_count: u64,
    /// Local training metrics (e.g. `loss`); averaged by example count.
    pub metrics: BTreeMap<String, f64>,
    /// Parameter delta (trained minus global), in the round's schema.
    pub delta: TensorPayload,
}

impl crate::codec::WithLargeBytes for UploadRequest {
    const LARGE_BYTES_AT: &'static [&'static str] = &["delta", "data"];

    fn put_large_bytes(&mut self, bytes: Vec<u8>) {
        self.delta.data = bytes;
    }
}

/// Answer to an accepted [`UploadRequest`]; sent only after the update is durable.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UploadAck {
    /// Run of the round.
    pub run_id: RunId,
    /// Round the update was accepted into.
    pub round_idx: RoundIdx,
}

/// `GET /v1/base-models/{hash}`: an imported pretrained model, whose content hash is that of
/// `payload` (SHA-256 of `schema`'s id and the values).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BaseModelDownload {
    /// Its tensors, in the payload's order.
    pub schema: TensorSchema,
    /// Its values.
    pub payload: TensorPayload,
}

/// `POST /v1/runs/{run}/evaluations`: metrics of a global model on a device's held-out data.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvaluationReport {
    /// Model version evaluated.
    pub model_version: ModelVersion,
    /// Number of held-out examples.
    pub example_count: u64,
    /// Metrics such as `accuracy` and `loss`.
    pub metrics: BTreeMap<String, f64>,
}

#[cfg(test)]
mod tests;

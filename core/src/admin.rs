//! The admin API's JSON views, shared by the coordinator that serves them and every client
//! (SDK, simulator, dashboard tooling) that reads them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `POST /v1/admin/enrollment-tokens` body.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewEnrollmentToken {
    /// How many devices may enroll with it: required, so that no token can mint devices
    /// without end (one unlimited token once enrolled 2 000 devices that took every cohort
    /// slot). At most [`MAX_TOKEN_USES`].
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 1_000_000))]
    pub uses: Option<i64>,
    /// The populations its devices may check in to (runs train a population); default
    /// `["default"]`. At most [`MAX_TOKEN_POPULATIONS`] names of at most
    /// [`MAX_POPULATION_NAME`] bytes.
    #[serde(default)]
    pub populations: Option<Vec<String>>,
    /// Lifetime in seconds (no expiry if absent).
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    pub ttl_secs: Option<i64>,
}

/// The most devices one enrollment token may enroll.
pub const MAX_TOKEN_USES: i64 = 1_000_000;
/// The most populations one enrollment token may name.
pub const MAX_TOKEN_POPULATIONS: usize = 64;
/// The longest population name, in bytes.
pub const MAX_POPULATION_NAME: usize = 128;

impl NewEnrollmentToken {
    /// The token's uses and populations, checked; the message names the field.
    pub fn checked(&self) -> Result<(i64, Vec<String>), String> {
        let uses = match self.uses {
            None => {
                return Err(format!(
                    "uses is required: the most devices this token may enroll (1..={MAX_TOKEN_USES})"
                ));
            }
            Some(u) if !(1..=MAX_TOKEN_USES).contains(&u) => {
                return Err(format!("uses must be in 1..={MAX_TOKEN_USES}"));
            }
            Some(u) => u,
        };
        if self.ttl_secs.is_some_and(|t| t < 1) {
            return Err("ttl_secs must be positive".into());
        }
        let populations = self.populations.clone().unwrap_or_else(|| vec!["default".to_owned()]);
        if populations.is_empty() || populations.len() > MAX_TOKEN_POPULATIONS {
            return Err(format!("populations must name 1..={MAX_TOKEN_POPULATIONS} populations"));
        }
        if let Some(bad) =
            populations.iter().find(|p| p.is_empty() || p.len() > MAX_POPULATION_NAME)
        {
            return Err(format!("population name {bad:?} must be 1..={MAX_POPULATION_NAME} bytes"));
        }
        Ok((uses, populations))
    }
}

/// An enrollment token as the admin API lists it: never the token itself.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnrollmentTokenView {
    /// The first 12 hex digits of the token's SHA-256: enough to tell tokens apart.
    pub id: String,
    /// When it was issued.
    pub created_at_ms: i64,
    /// Expiry, if any.
    pub expires_at_ms: Option<i64>,
    /// Devices it may still enroll (`None`: unlimited, only tokens from before limits were
    /// required).
    pub uses_left: Option<i64>,
    /// The populations its devices may join (`None`: any, only tokens from before tokens named
    /// populations).
    pub populations: Option<Vec<String>>,
}

/// A freshly issued enrollment token; shown once, stored only as a hash.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Serialize, Deserialize)]
pub struct EnrollmentToken {
    /// The token.
    pub token: String,
    /// Expiry, if any.
    pub expires_at_ms: Option<i64>,
}

/// An enrolled device as the admin API shows it (never its credential).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceView {
    /// Device id.
    pub device_id: i64,
    /// When it enrolled.
    pub enrolled_at_ms: i64,
    /// Whether its credential was revoked; a revoked device can no longer call the fleet API.
    pub revoked: bool,
}

/// A run as the admin API shows it.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Serialize, Deserialize)]
pub struct RunView {
    /// Run id.
    pub id: i64,
    /// Display name.
    pub name: Option<String>,
    /// Population.
    pub population: String,
    /// `running`, `finished` or `stopped`.
    pub status: String,
    /// Why the coordinator stopped the run (rounds failing in a row, its privacy accounting or
    /// a round's close failing, a stored plan this version refuses); absent when the operator
    /// stopped it or it has not stopped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<String>,
    /// Latest committed model version.
    pub model_version: i64,
    /// Its content hash.
    pub model_hash: Option<String>,
    /// Rounds committed.
    pub rounds_committed: i64,
    /// Rounds planned.
    pub total_rounds: u32,
    /// Creation time.
    pub created_at_ms: i64,
    /// Last transition.
    pub updated_at_ms: i64,
    /// The plan.
    pub plan: serde_json::Value,
    /// How the devices' own accuracies spread on the latest model two or more devices
    /// evaluated (a personalized run's devices evaluate with their own local tensors): see
    /// [`ModelView::device_accuracy`]; absent before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_accuracy: Option<DeviceSpread>,
    /// The model version `device_accuracy` is of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_accuracy_version: Option<i64>,
    /// What a differentially private run has spent; absent for other runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub privacy: Option<PrivacyView>,
}

/// A differentially private run's guarantee so far.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrivacyView {
    /// ε spent at `delta` over the committed rounds (RDP accountant of the sampling that runs,
    /// `accounting`).
    pub epsilon: f64,
    /// The plan's δ.
    pub delta: f64,
    /// The plan's ε budget, if any.
    pub epsilon_budget: Option<f64>,
    /// Rounds the run may commit within its budget (the plan's rounds without one).
    pub rounds_allowed: u32,
    /// Sampling rate q accounted: devices selected per round over the population (with a
    /// fixed-size draw, the largest any committed round had: each measured at least the
    /// population).
    pub sampling_rate: f64,
    /// The mechanism the accountant composes: the sampling and the neighbouring relation.
    pub accounting: String,
    /// ε by the Rényi DP accountant.
    pub epsilon_rdp: f64,
    /// ε by the privacy loss distribution accountant (Poisson sampling only); `epsilon` is
    /// the smaller of the two.
    pub epsilon_pld: Option<f64>,
    /// Noise multiplier z accounted.
    pub noise_multiplier: f64,
    /// Where updates are clipped and noise is added.
    pub mechanism: String,
    /// What the run releases beside its noised model: nothing, or the cohort's training loss
    /// and pooled evaluation noised in the same accounting (with the noise on each).
    pub metrics: String,
    /// Against whom `epsilon` holds: it assumes amplification by sampling, which holds against
    /// the devices and anyone who sees only the released models, not against the coordinator,
    /// which chooses and knows each cohort.
    pub holds_against: String,
    /// With distributed noise, the ε that holds against the coordinator (no amplification),
    /// by how many rounds a device took part in; absent with central noise, where the
    /// coordinator sees the un-noised sum.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub against_coordinator: Option<AgainstCoordinator>,
    /// With `blt_ftrl`, the zCDP ρ of the committed rounds (`epsilon` is the Gaussian
    /// mechanism's exact ε for the same μ = √(2ρ)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zcdp_rho: Option<f64>,
}

/// A distributed-DP run's ε against the coordinator, which knows who is in each cohort.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AgainstCoordinator {
    /// Rounds a device takes part in on average so far: q × committed rounds, rounded up.
    pub expected_participations: u64,
    /// ε after that many participations.
    pub epsilon_expected: f64,
    /// ε of a device that took part in every committed round (the worst case).
    pub epsilon_every_round: f64,
}

impl PrivacyView {
    /// The view of `privacy` after `rounds_committed` rounds; `secure` when devices clip and the
    /// noise goes onto the unmasked sum.
    pub fn new(privacy: &crate::privacy::Privacy, rounds_committed: u64, secure: bool) -> Self {
        let spent = privacy.spent(rounds_committed);
        let expected = (privacy.sampling_rate * rounds_committed as f64).ceil() as u64;
        let against_coordinator =
            privacy.epsilon_against_coordinator(expected).map(|e| AgainstCoordinator {
                expected_participations: expected,
                epsilon_expected: e,
                epsilon_every_round: privacy
                    .epsilon_against_coordinator(rounds_committed)
                    .unwrap_or(f64::INFINITY),
            });
        let holds_against = match &against_coordinator {
            _ if privacy.blt.is_some() => {
                "epsilon: against the devices and whoever sees the released models, whatever the selection (no sampling assumed: the coordinator enforces the participation rule); none against the coordinator, which adds the noise to a sum it sees first"
            }
            Some(_) => {
                "epsilon: against the devices and whoever sees the released models (amplified by the cohort's sampling); against_coordinator: against the coordinator, which knows each cohort (no amplification)"
            }
            None => {
                "epsilon: against the devices and whoever sees the released models (amplified by the cohort's sampling); none against the coordinator, which adds the noise to a sum it sees first"
            }
        };
        PrivacyView {
            epsilon: spent.epsilon(),
            delta: privacy.plan.delta,
            epsilon_budget: privacy.plan.epsilon_budget,
            rounds_allowed: privacy.rounds_allowed,
            sampling_rate: privacy.sampling_rate,
            accounting: privacy.describe(),
            epsilon_rdp: spent.rdp,
            epsilon_pld: spent.pld,
            noise_multiplier: privacy.plan.noise_multiplier,
            mechanism: if privacy.blt.is_some() {
                "DP-FTRL: devices' updates clipped; central Gaussian noise correlated across rounds (BLT) on the sum, the server's step a prefix sum of the releases".into()
            } else if privacy.distributed.is_some() {
                "devices clip and add discrete Gaussian noise before masking; the coordinator unmasks a noisy sum".into()
            } else if secure {
                "devices clip; central Gaussian noise on the unmasked secure sum".into()
            } else if privacy.plan.adaptive_clipping.is_some() {
                "coordinator clips (adaptive clip norm); central Gaussian noise on the sum".into()
            } else {
                "coordinator clips; central Gaussian noise on the sum".into()
            },
            metrics: match (privacy.plan.metrics, privacy.metrics_stddev) {
                (crate::privacy::MetricsRelease::Noised(m), Some(sd)) => format!(
                    "noised: the cohort's training loss (clipped to {}) and pooled evaluation, each sum with N(0, {sd}²) inside the accounted mechanism; update noise multiplier {:.4}",
                    m.loss_bound, privacy.update_noise_multiplier
                ),
                _ => "withheld: devices send no metrics or evaluations".into(),
            },
            holds_against: holds_against.into(),
            against_coordinator,
            zcdp_rho: privacy.zcdp_rho(rounds_committed),
        }
    }
}

/// A round as the admin API shows it.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Serialize, Deserialize)]
pub struct RoundView {
    /// Round index.
    pub round_idx: i64,
    /// Model version trained on.
    pub model_version: i64,
    /// `open`, `committed` or `failed`.
    pub state: String,
    /// Opening time.
    pub opened_at_ms: i64,
    /// End of selection.
    pub selection_deadline_ms: i64,
    /// Reporting deadline.
    pub reporting_deadline_ms: i64,
    /// Closing time.
    pub closed_at_ms: Option<i64>,
    /// Devices selected; absent in a differentially private run with `poisson` selection,
    /// whose cohort sizes are not shown (the size of a Poisson draw tells whether one more
    /// device was in the population).
    pub n_selected: Option<i64>,
    /// Durable updates; absent where `n_selected` is.
    pub n_reported: Option<i64>,
    /// Selected but not reported (once closed); absent where `n_selected` is. In an
    /// asynchronous run these devices may still report into a later buffer.
    pub n_dropped: Option<i64>,
    /// Durable updates trained on an earlier model than this round's (asynchronous runs; 0
    /// otherwise).
    #[serde(default)]
    pub n_stale: i64,
    /// How it ended.
    pub outcome: Option<serde_json::Value>,
    /// Example-weighted mean of the clients' training metrics.
    pub metrics: Option<BTreeMap<String, f64>>,
    /// Uploads refused in this round, as counted by the serving coordinator since it started
    /// (absent for rounds it did not see, and where `n_selected` is).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_rejected: Option<u64>,
    /// Bytes of acknowledged uploads, counted (and absent) like `n_rejected`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upload_bytes: Option<u64>,
}

/// A committed model version with its federated evaluation.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Serialize, Deserialize)]
pub struct ModelView {
    /// Version.
    pub version: i64,
    /// Content hash (`GET /v1/models/{hash}`).
    pub content_hash: String,
    /// Round that produced it.
    pub round_idx: Option<i64>,
    /// Commit time.
    pub created_at_ms: i64,
    /// Its bytes were given up: the run writes a model every `checkpoint_interval` versions
    /// and a later one is written, so it can no longer be exported or downloaded.
    #[serde(default)]
    pub given_up: bool,
    /// Evaluation reports received for this version (federated: devices' held-out data).
    pub n_evaluations: u64,
    /// Example-weighted means of the evaluation metrics.
    pub evaluation: BTreeMap<String, f64>,
    /// Central evaluations: the server side's held-out sets, by evaluator.
    #[serde(default)]
    pub central: Vec<CentralEvaluation>,
    /// How the devices' own accuracies spread, each reporting device counting once (a
    /// personalized run's devices evaluate with their own local tensors); absent without two
    /// device reports of accuracy. Pooled reports (a secure cohort's) are not in it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_accuracy: Option<DeviceSpread>,
}

/// How a metric spreads across devices, each counting once.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DeviceSpread {
    /// Devices.
    pub devices: u64,
    /// Their mean (unweighted).
    pub mean: f64,
    /// Their standard deviation (population, around `mean`).
    pub std: f64,
    /// The lowest.
    pub min: f64,
    /// The highest.
    pub max: f64,
}

impl DeviceSpread {
    /// The spread of `values`; `None` for fewer than two.
    pub fn of(values: &[f64]) -> Option<Self> {
        if values.len() < 2 {
            return None;
        }
        let n = values.len() as f64;
        let mean = values.iter().sum::<f64>() / n;
        let std = (values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n).sqrt();
        let min = values.iter().copied().fold(f64::INFINITY, f64::min);
        let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        Some(DeviceSpread { devices: values.len() as u64, mean, std, min, max })
    }
}

/// A central evaluator's evaluation of one model version on its held-out set
/// (`POST /v1/admin/runs/{run}/models/{version}/evaluations`, and in [`ModelView::central`]).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CentralEvaluation {
    /// The evaluator's name (1..=64 of `A-Z a-z 0-9 . _ -`); a second report under the same
    /// name replaces the first.
    pub evaluator: String,
    /// Held-out examples evaluated.
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    pub example_count: u64,
    /// Metrics (`accuracy` in [0, 1], `loss` ≥ 0, any other finite within ±1e12).
    pub metrics: BTreeMap<String, f64>,
}

/// A device selected for a round, and whether its contribution reached the round
/// (`GET /v1/admin/runs/{run}/rounds/{round}/devices`): the record of who trained what.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoundDeviceView {
    /// Device id.
    pub device_id: i64,
    /// When it was selected.
    pub selected_at_ms: i64,
    /// The aggregator it was sent to, when the round went through the aggregator tier.
    pub aggregator_id: Option<i64>,
    /// How its contribution reached the round: `update` (its own durable upload) or `partial`
    /// (inside an aggregator's durable partial). Absent when none is recorded: it dropped out,
    /// is still training, or the round was secure (which keeps no per-device record).
    pub reported: Option<String>,
    /// The example count (FedAvg weight) of its upload, for `update`; absent in a
    /// differentially private run, which shows no device's count un-noised.
    pub example_count: Option<i64>,
}

/// A Hugging Face tokenizer an operator imported (`POST /v1/admin/tokenizers`), which a plan's
/// `model.tokenizer` names by `content_hash`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenizerView {
    /// Content hash: SHA-256 of the `tokenizer.json` file's bytes.
    pub content_hash: String,
    /// The name it was imported under.
    pub name: String,
    /// One more than its largest token id (added tokens included): the smallest vocabulary a
    /// model spec's token input may have to take its ids.
    pub vocab_size: u64,
    /// The file's bytes.
    pub bytes: u64,
    /// Import time.
    pub created_at_ms: i64,
}

/// A pretrained model an operator imported (`POST /v1/admin/base-models`), which a plan's
/// `init` names by `content_hash` (`{"kind": "base_model", "hash": ...}`).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BaseModelView {
    /// Content hash: SHA-256 of the schema id and the values, as a run's models are addressed.
    pub content_hash: String,
    /// The name it was imported under.
    pub name: String,
    /// Its tensors, in the order of their data in the file.
    pub schema: crate::tensor::TensorSchema,
    /// Its values' bytes.
    pub bytes: u64,
    /// Import time.
    pub created_at_ms: i64,
}

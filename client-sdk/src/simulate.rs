//! The simulator: N real SDK participants (each its own HTTP client, each its own slice of a
//! real dataset) as tasks in one process, against a coordinator URL.
//!
//! It creates the run through the admin API, partitions the data, runs the participants until
//! the run ends, and evaluates every committed global model on the held-out test set, reporting
//! the curve round by round.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde::Serialize;
use starling_core::model_spec::ModelSpec;
use starling_core::wire::ErrorCode;
use starling_core::{DeviceId, RunId};

use crate::backend::Backend;
use crate::data::{DataError, Dataset, FederatedData, Partition, federated_data_scaled};
use crate::evaluate::CentralEvaluator;
use crate::examples::Examples;
use crate::participant::{Outcome, Participant, TrainingSlots};
use crate::protocol::{AdminClient, ClientError, TlsSettings};

/// The name the simulator's evaluations of the global model are reported under.
pub const SIMULATOR_EVALUATOR: &str = "simulator";

/// What a poisoning device does to its honest delta before it uploads it (Byzantine clients
/// in the robust-aggregation literature).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Attack {
    /// The delta multiplied by this factor: a boosted update that drags a mean its way.
    Scale(f32),
    /// The delta reversed and multiplied by this factor: the update pushes training back.
    SignFlip(f32),
}

impl Attack {
    /// The factor the attack multiplies the honest delta by.
    pub fn factor(&self) -> f32 {
        match *self {
            Attack::Scale(f) => f,
            Attack::SignFlip(f) => -f,
        }
    }

    /// The poisoned delta, in place.
    pub fn apply(&self, delta: &mut [f32]) {
        let factor = self.factor();
        delta.iter_mut().for_each(|d| *d *= factor);
    }
}

impl std::str::FromStr for Attack {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let expected = || format!("{s:?}: expected scale:FACTOR or sign_flip[:FACTOR]");
        let (kind, factor) = match s.split_once(':') {
            Some(split) => split,
            None if s == "sign_flip" => (s, "1"),
            None => return Err(expected()),
        };
        let factor: f32 = factor.parse().map_err(|e| format!("attack factor {factor:?}: {e}"))?;
        if !factor.is_finite() || factor <= 0.0 {
            return Err(format!("attack factor must be positive and finite, not {factor}"));
        }
        match kind {
            "scale" => Ok(Attack::Scale(factor)),
            "sign_flip" => Ok(Attack::SignFlip(factor)),
            _ => Err(expected()),
        }
    }
}

/// Which simulated devices poison their updates, and how.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Poisoning {
    /// Share of the simulated devices that attack (rounded to the nearest device; the first
    /// clients of the partition, whose data is as random as any other's).
    pub fraction: f64,
    /// What each of them does.
    pub attack: Attack,
}

impl Poisoning {
    /// How many of `clients` devices attack.
    pub fn attackers(&self, clients: usize) -> usize {
        ((self.fraction * clients as f64).round() as usize).min(clients)
    }
}

/// A named model for the image datasets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ModelKind {
    /// Two hidden layers of 200 (the FedAvg paper's 2NN); 64 for the 8×8 digits.
    Mlp,
    /// The FedAvg paper's CNN (5×5 convs of 32 and 64 channels, 512-unit dense).
    Cnn,
}

/// Everything a simulation needs.
#[derive(Debug, Clone)]
pub struct SimulationConfig {
    /// Coordinator base URL.
    pub url: String,
    /// Operator token (the simulator creates the run).
    pub operator_token: String,
    /// How the simulated devices and the operator client verify an `https://` coordinator.
    pub tls: TlsSettings,
    /// Simulated devices.
    pub clients: usize,
    /// Reports per round.
    pub cohort: u32,
    /// Rounds to commit.
    pub rounds: u32,
    /// Dataset.
    pub dataset: Dataset,
    /// `shared/data`.
    pub data_dir: PathBuf,
    /// Split over clients.
    pub partition: Partition,
    /// Model.
    pub model: ModelKind,
    /// Training configuration JSON passed in the plan.
    pub training: serde_json::Value,
    /// Seed for partitioning and initialization.
    pub seed: u64,
    /// Use at most this many training examples (0: all).
    pub max_examples: usize,
    /// Where the simulated devices train and the test set is evaluated.
    pub backend: Backend,
    /// Aggregate with SecAgg+: the coordinator learns only each cohort's weighted sum.
    pub secure: bool,
    /// The device population the run trains and the simulated devices check in to. `None`: a
    /// population of the simulation's own, named after its run, so that simulations sharing a
    /// coordinator never train each other's runs.
    pub population: Option<String>,
    /// How rounds are paced (the plan's selection and deadlines).
    pub pacing: Pacing,
    /// Fraction of each device's examples held out to evaluate the global model on (the
    /// federated evaluation); the rest is trained on. 0 trains on everything.
    pub holdout: f64,
    /// The plan's `strategy` (server optimizer, robust aggregation, differential privacy);
    /// `null`: FedAvg.
    pub strategy: serde_json::Value,
    /// How each round's cohort is drawn from the devices checking in.
    pub selection: starling_core::plan::SelectionPolicy,
    /// Devices that poison their updates (`None`: every device is honest).
    pub poisoning: Option<Poisoning>,
    /// The encoding devices upload their deltas in (the plan's `compression`).
    pub compression: starling_core::compression::Compression,
    /// The encoding devices download the model in (the plan's `model_download`).
    pub model_download: starling_core::compression::Compression,
    /// Asynchronous buffered aggregation (the plan's `asynchronous`; `None`: rounds).
    pub asynchronous: Option<starling_core::plan::AsynchronousPlan>,
    /// Devices that train slower than the rest (`None`: all alike).
    pub slowdown: Option<Slowdown>,
    /// How often the run's model bytes are written (the plan's `checkpoint_interval`; 1:
    /// every version).
    pub checkpoint_interval: u32,
    /// Which committed models are scored on the test set, and on how much of it.
    pub scoring: Scoring,
    /// Draw each round's cohort from `seed` in the simulator (exactly `cohort` clients, the
    /// same ones for the same seed) and derive each client's per-round training seed from
    /// `seed`, its index and the round, so that the same seed repeats a run bit for bit on an
    /// idle machine. Not with DP (the coordinator draws a DP cohort, and its noise is secret)
    /// or asynchronous runs (their updates race by design).
    pub seeded_cohorts: bool,
    /// The longest the whole simulation may take: past it the simulator stops its run and
    /// fails with a summary ([`SimulationError::TimedOut`]); `None`: no limit.
    pub timeout: Option<Duration>,
    /// Stop the run once a scored model reaches this test accuracy (0 to 1), and end
    /// successfully; `None`: train every round.
    pub target: Option<f64>,
    /// The next-character model's shape (token datasets).
    pub lstm: LstmShape,
    /// How much of Shakespeare is taken.
    pub shakespeare: crate::data::ShakespeareScale,
}

/// Which committed models a simulation scores on the test set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scoring {
    /// Score every `every`-th version (and the run's last); 1 scores them all.
    pub every: u32,
    /// Score on this many test examples (a seeded sample), not the whole test set.
    pub examples: Option<usize>,
    /// Score the initial model (version 0) too, before any round: the curve's round-0 row.
    pub initial: bool,
}

impl Default for Scoring {
    fn default() -> Self {
        Scoring { every: 1, examples: None, initial: false }
    }
}

impl Scoring {
    /// Whether version `version` of a run of `total` versions is scored.
    pub fn scores(&self, version: i64, total: i64) -> bool {
        version == total || version % i64::from(self.every.max(1)) == 0
    }
}

/// The shape of the next-character model a token dataset (Shakespeare) trains: an embedding,
/// `layers` stacked LSTMs of `hidden` units, the last step's state, a linear map to the
/// vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LstmShape {
    /// Stacked LSTM layers.
    pub layers: u32,
    /// Units per LSTM layer.
    pub hidden: u32,
    /// Embedding width.
    pub embedding: u32,
}

impl Default for LstmShape {
    /// One LSTM of 64 units over an 8-dimensional embedding: minutes on two cores.
    fn default() -> Self {
        LstmShape { layers: 1, hidden: 64, embedding: 8 }
    }
}

/// The FedAvg paper's settings (McMahan et al. 2017), as `starling-client simulate --preset`
/// offers them: MNIST (100 clients of 600 examples, C = 0.1, B = 10; E = 1 for the 2NN, 5 for
/// the CNN) and Shakespeare (one client per role, a 2 × 256 LSTM over an 8-dimensional
/// embedding, all of each role's text, C ≈ 0.1, E = 1, B = 10, η = 1.47).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Preset {
    /// The 2NN (two hidden layers of 200), E = 1, B = 10, η = 0.1.
    #[value(name = "fedavg-mnist-2nn")]
    FedAvgMnist2nn,
    /// The CNN (two 5×5 convolutions, 512-unit dense), E = 5, B = 10, η = 0.05.
    #[value(name = "fedavg-mnist-cnn")]
    FedAvgMnistCnn,
    /// Shakespeare's 1 423 roles, 142 a round, the 2 × 256 LSTM on every window of each role:
    /// the paper's scale (hours on two cores).
    #[value(name = "fedavg-shakespeare")]
    FedAvgShakespeare,
}

/// The settings a simulation starts from: the simulator's own defaults, or a preset's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Settings {
    /// Simulated devices (the paper's K).
    pub clients: usize,
    /// Reports per round (C·K).
    pub cohort: u32,
    /// Rounds.
    pub rounds: u32,
    /// Dataset.
    pub dataset: Dataset,
    /// Split over clients.
    pub partition: Partition,
    /// Model.
    pub model: ModelKind,
    /// Local epochs (E).
    pub epochs: u32,
    /// Local batch size (B).
    pub batch_size: u32,
    /// Local learning rate (η).
    pub lr: f64,
    /// Share of each client's examples held out for federated evaluation.
    pub holdout: f64,
    /// Devices selected per round, as a multiple of the cohort.
    pub over_selection: f64,
    /// Fewest reports a round commits with (`None`: 80 % of the cohort).
    pub min_quorum: Option<u32>,
    /// Longest time from a round's opening to its close, in seconds.
    pub reporting_timeout_secs: f64,
    /// FedProx's proximal weight μ (0: plain FedAvg).
    pub fedprox_mu: f64,
    /// The devices' local optimizer.
    pub local_optimizer: starling_core::plan::LocalOptimizer,
    /// The next-character model's shape (token datasets).
    pub lstm: LstmShape,
    /// How much of Shakespeare is taken.
    pub shakespeare: crate::data::ShakespeareScale,
}

impl Settings {
    /// The simulator's defaults: a quick run on the bundled digits.
    pub fn simulator_defaults(clients: Option<usize>) -> Self {
        let clients = clients.unwrap_or(24);
        Settings {
            clients,
            cohort: (clients / 2).max(1) as u32,
            rounds: 15,
            dataset: Dataset::Digits,
            partition: Partition::Iid,
            model: ModelKind::Mlp,
            epochs: 5,
            batch_size: 10,
            lr: 0.1,
            holdout: 0.1,
            over_selection: Pacing::default().over_selection,
            min_quorum: None,
            reporting_timeout_secs: Pacing::default().reporting_timeout_secs,
            fedprox_mu: 0.0,
            local_optimizer: Default::default(),
            lstm: LstmShape::default(),
            shakespeare: Default::default(),
        }
    }
}

impl Preset {
    /// The preset's settings: MNIST over 100 clients (600 examples each, IID), exactly 10 of
    /// them per round (no over-selection, every one must report), no examples held out, and the
    /// default reporting deadline (the CNN's round takes under a minute on a two-core CPU).
    pub fn settings(self) -> Settings {
        let (model, epochs, lr, rounds) = match self {
            Preset::FedAvgMnist2nn => (ModelKind::Mlp, 1, 0.1, 200),
            Preset::FedAvgMnistCnn => (ModelKind::Cnn, 5, 0.05, 100),
            Preset::FedAvgShakespeare => {
                return Settings {
                    clients: 1423,
                    cohort: 142,
                    rounds: 100,
                    dataset: Dataset::Shakespeare,
                    epochs: 1,
                    lr: 1.47,
                    min_quorum: Some(142),
                    lstm: LstmShape { layers: 2, hidden: 256, embedding: 8 },
                    shakespeare: crate::data::ShakespeareScale {
                        windows_per_role: 0,
                        test_roles: 64,
                    },
                    // A round of 142 roles' whole text on a CPU takes long.
                    reporting_timeout_secs: 86_400.0,
                    ..Preset::FedAvgMnist2nn.settings()
                };
            }
        };
        Settings {
            clients: 100,
            cohort: 10,
            rounds,
            dataset: Dataset::Mnist,
            partition: Partition::Iid,
            model,
            epochs,
            batch_size: 10,
            lr,
            holdout: 0.0,
            over_selection: 1.0,
            min_quorum: Some(10),
            reporting_timeout_secs: Pacing::default().reporting_timeout_secs,
            fedprox_mu: 0.0,
            local_optimizer: Default::default(),
            lstm: LstmShape::default(),
            shakespeare: Default::default(),
        }
    }
}

/// A fleet's heterogeneity: a share of the devices takes `factor` times as long to train.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slowdown {
    /// Share of the simulated devices that are slow (rounded to whole devices; the last ones,
    /// so that attackers, the first, are not also the slow ones).
    pub fraction: f64,
    /// How many times as long they take.
    pub factor: f64,
}

impl std::str::FromStr for Slowdown {
    type Err = String;

    /// `FRACTION:FACTOR`, e.g. `0.2:5`: a fifth of the devices five times slower.
    fn from_str(text: &str) -> Result<Self, String> {
        let (fraction, factor) =
            text.split_once(':').ok_or_else(|| format!("{text:?} is not FRACTION:FACTOR"))?;
        let fraction: f64 = fraction.parse().map_err(|e| format!("fraction {fraction:?}: {e}"))?;
        let factor: f64 = factor.parse().map_err(|e| format!("factor {factor:?}: {e}"))?;
        if !(0.0..=1.0).contains(&fraction) {
            return Err(format!("the slow fraction must be in [0, 1], not {fraction}"));
        }
        if !(factor.is_finite() && (1.0..=1000.0).contains(&factor)) {
            return Err(format!("the slowdown factor must be in [1, 1000], not {factor}"));
        }
        Ok(Slowdown { fraction, factor })
    }
}

impl Slowdown {
    /// How many of `clients` devices are slow.
    pub fn slow_devices(&self, clients: usize) -> usize {
        (self.fraction * clients as f64).round() as usize
    }
}

/// A simulated run's round pacing: the plan fields a simulation sets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pacing {
    /// Devices selected per round, as a multiple of the cohort.
    pub over_selection: f64,
    /// Fewest reports a round commits with (`None`: 80 % of the cohort).
    pub min_quorum: Option<u32>,
    /// Longest time a round selects devices.
    pub selection_timeout_secs: f64,
    /// Longest time from a round's opening to its close; it must cover local training (the
    /// FedAvg paper's CNN at E=5 takes minutes per round on a CPU).
    pub reporting_timeout_secs: f64,
}

impl Default for Pacing {
    fn default() -> Self {
        Pacing {
            over_selection: 1.3,
            min_quorum: None,
            selection_timeout_secs: 10.0,
            reporting_timeout_secs: 120.0,
        }
    }
}

/// What a finished simulation reports.
#[derive(Debug, Clone)]
pub struct SimulationReport {
    /// The run it created.
    pub run_id: RunId,
    /// The population the run trained and its devices checked in to.
    pub population: String,
    /// The simulated devices, as the coordinator enrolled them.
    pub devices: Vec<DeviceId>,
    /// Every committed model, in order; with a `checkpoint_interval`, less the versions given
    /// up before the simulator evaluated them.
    pub rounds: Vec<RoundResult>,
    /// The versions given up (a later one was written) before the simulator evaluated them.
    pub not_evaluated: Vec<i64>,
    /// The rounds that failed, in order, with why.
    pub failed_rounds: Vec<FailedRound>,
}

/// A round that failed, as the simulator saw it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FailedRound {
    /// Its index.
    pub round_idx: i64,
    /// Why (the round's outcome: `too_few_reports`, `too_few_selected`, ... with its counts).
    pub outcome: String,
}

impl std::fmt::Display for FailedRound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "round {} failed: {}", self.round_idx, self.outcome)
    }
}

/// One committed round as the simulator saw it.
#[derive(Debug, Clone, Serialize)]
pub struct RoundResult {
    /// Model version committed.
    pub version: i64,
    /// Its accuracy on the test set.
    pub test_accuracy: f64,
    /// Its loss on the test set.
    pub test_loss: f64,
    /// Mean local training loss of the round that produced it.
    pub train_loss: Option<f64>,
    /// Updates aggregated; `None` where the run shows no cohort sizes (a differentially
    /// private run with `poisson` selection).
    pub reported: Option<i64>,
    /// Selected devices that did not report; `None` as for `reported`.
    pub dropped: Option<i64>,
    /// Seconds since the simulation created its run, when the model was scored.
    pub elapsed_secs: f64,
    /// Seconds the round that produced it was open.
    pub round_secs: Option<f64>,
    /// Bytes of the updates that round took.
    pub upload_bytes: Option<u64>,
    /// ε spent once this model was committed, in a DP run (the run's own accountant).
    pub epsilon: Option<f64>,
    /// The model's content hash (two runs that repeat each other commit the same ones).
    pub content_hash: String,
}

impl RoundResult {
    /// The CSV header of [`RoundResult::csv_row`].
    pub const CSV_HEADER: &'static str = "version,test_accuracy,test_loss,train_loss,reported,dropped,elapsed_secs,round_secs,upload_bytes,epsilon,content_hash";

    /// One CSV row (empty fields where a value is absent).
    pub fn csv_row(&self) -> String {
        fn opt<T: ToString>(v: Option<T>) -> String {
            v.map_or(String::new(), |v| v.to_string())
        }
        format!(
            "{},{},{},{},{},{},{:.3},{},{},{},{}",
            self.version,
            self.test_accuracy,
            self.test_loss,
            opt(self.train_loss),
            opt(self.reported),
            opt(self.dropped),
            self.elapsed_secs,
            opt(self.round_secs),
            opt(self.upload_bytes),
            opt(self.epsilon),
            self.content_hash
        )
    }
}

/// Why a simulation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SimulationError {
    /// The dataset could not be loaded.
    #[error(transparent)]
    Data(#[from] DataError),
    /// The coordinator failed.
    #[error(transparent)]
    Protocol(#[from] ClientError),
    /// A participant failed for good.
    #[error("participant: {0}")]
    Participant(String),
    /// The run ended without committing every round (the coordinator stopped it, or the
    /// operator did).
    #[error("the run ended {status}{}: {summary}", reason.as_ref().map(|r| format!(" ({r})")).unwrap_or_default())]
    RunEnded {
        /// `stopped`.
        status: String,
        /// Why the coordinator stopped it, when it did.
        reason: Option<String>,
        /// Rounds committed and failed so far.
        summary: String,
    },
    /// The simulation's `timeout` passed before the run finished: the simulator stopped it.
    #[error("the simulation did not finish within {secs:.0} s; its run was stopped: {summary}")]
    TimedOut {
        /// The timeout.
        secs: f64,
        /// Rounds committed and failed so far.
        summary: String,
    },
    /// Another run is training the population the simulation was asked to use: its devices
    /// would join that run too.
    #[error("{why}: pick another population, or let the simulator make its own")]
    PopulationBusy {
        /// The population.
        population: String,
        /// The coordinator's refusal, naming the run in the way.
        why: String,
    },
    /// The configuration cannot make a valid simulation.
    #[error("invalid simulation: {0}")]
    Invalid(String),
}

/// A warning when a DP simulation's noise would drown its updates: the Gaussian noise on each
/// coordinate of a round's mean (z·C/m, m devices) over a clipped update's typical coordinate
/// (C/√d for d parameters), i.e. z·√d/m, above 1. The ε = 4 preset with 10 clients per round
/// sat at 9-12 % accuracy with no word of why.
pub fn dp_noise_warning(config: &SimulationConfig) -> Option<String> {
    let dp = config.strategy.get("differential_privacy").filter(|d| !d.is_null())?;
    let z = dp.get("noise_multiplier")?.as_f64()?;
    let spec = model_spec_with(config.model, config.dataset.input(), config.lstm);
    let d = spec.schema().ok()?.numel() as f64;
    let m = f64::from(config.cohort.max(1));
    let ratio = z * d.sqrt() / m;
    (ratio > 1.0).then(|| {
        format!(
            "the DP noise on each coordinate of a round's mean is {ratio:.1}× a clipped update's \
             typical coordinate (noise multiplier {z:.3}, {d} parameters, {m} devices a round): \
             expect little learning; it takes more than {:.0} devices a round (z·√d), or a \
             smaller model",
            z * d.sqrt()
        )
    })
}

/// The model spec for `kind` on `input` (token inputs get an Embedding → LSTM next-token model
/// of the default [`LstmShape`]).
pub fn model_spec(kind: ModelKind, input: starling_core::model_spec::InputSpec) -> ModelSpec {
    model_spec_with(kind, input, LstmShape::default())
}

/// [`model_spec`], token inputs getting the next-character model of `lstm`'s shape.
pub fn model_spec_with(
    kind: ModelKind,
    input: starling_core::model_spec::InputSpec,
    lstm: LstmShape,
) -> ModelSpec {
    if let starling_core::model_spec::InputSpec::Tokens { vocab, .. } = input {
        let mut layers = vec![serde_json::json!({"kind": "embedding", "dim": lstm.embedding})];
        for _ in 0..lstm.layers.max(1) {
            layers.push(serde_json::json!({"kind": "lstm", "hidden": lstm.hidden}));
        }
        layers.push(serde_json::json!({"kind": "last_step"}));
        layers.push(serde_json::json!({"kind": "linear", "out": vocab}));
        return serde_json::from_value(serde_json::json!({"input": input, "layers": layers}))
            .expect("built-in specs are valid");
    }
    let small = matches!(input, starling_core::model_spec::InputSpec::Image { height: 8, .. });
    let layers = match kind {
        ModelKind::Mlp => {
            let h = if small { 64 } else { 200 };
            serde_json::json!([{"kind": "flatten"}, {"kind": "linear", "out": h}, {"kind": "relu"},
                {"kind": "linear", "out": h}, {"kind": "relu"}, {"kind": "linear", "out": 10}])
        }
        ModelKind::Cnn => serde_json::json!([
            {"kind": "conv2d", "out_channels": 32, "kernel": 5, "padding": 2}, {"kind": "relu"}, {"kind": "max_pool2d", "kernel": 2},
            {"kind": "conv2d", "out_channels": 64, "kernel": 5, "padding": 2}, {"kind": "relu"}, {"kind": "max_pool2d", "kernel": 2},
            {"kind": "flatten"}, {"kind": "linear", "out": 512}, {"kind": "relu"}, {"kind": "linear", "out": 10}]),
    };
    serde_json::from_value(serde_json::json!({"input": input, "layers": layers}))
        .expect("built-in specs are valid")
}

/// Runs a whole simulation, calling `on_round` for each committed model in order.
///
/// The run trains a population of its own unless `config.population` names one, and then only
/// if no other running run trains it: a simulated device checks in to its population and would
/// train whichever run of it is open.
pub async fn simulate(
    config: SimulationConfig,
    on_round: impl FnMut(&RoundResult),
) -> Result<SimulationReport, SimulationError> {
    simulate_reporting(config, on_round, |failed| tracing::warn!("{failed}")).await
}

/// [`simulate`], calling `on_failed` for each round that fails, as it fails.
pub async fn simulate_reporting(
    config: SimulationConfig,
    on_round: impl FnMut(&RoundResult),
    on_failed: impl FnMut(&FailedRound),
) -> Result<SimulationReport, SimulationError> {
    if !(0.0..1.0).contains(&config.holdout) {
        return Err(SimulationError::Invalid(format!(
            "holdout must be in [0, 1), not {}",
            config.holdout
        )));
    }
    if let Some(p) = config.poisoning.filter(|p| !(0.0..=1.0).contains(&p.fraction)) {
        return Err(SimulationError::Invalid(format!(
            "the attacking fraction must be in [0, 1], not {}",
            p.fraction
        )));
    }
    if config.scoring.every == 0 || config.scoring.examples == Some(0) {
        return Err(SimulationError::Invalid(
            "scoring needs a positive interval and example count".into(),
        ));
    }
    if config.seeded_cohorts {
        if !config.strategy["differential_privacy"].is_null() {
            return Err(SimulationError::Invalid(
                "a DP run cannot repeat bit for bit: the coordinator draws its cohorts and its noise is secret".into(),
            ));
        }
        if config.asynchronous.is_some() {
            return Err(SimulationError::Invalid(
                "an asynchronous run cannot repeat bit for bit: its updates race by design".into(),
            ));
        }
        if config.cohort as usize > config.clients {
            return Err(SimulationError::Invalid(format!(
                "a cohort of {} from {} clients",
                config.cohort, config.clients
            )));
        }
    }
    let FederatedData { train: train_set, test: test_set, clients: parts } = federated_data_scaled(
        config.dataset,
        &config.data_dir,
        config.clients,
        config.partition,
        config.max_examples,
        config.seed,
        config.shakespeare,
    )?;
    let spec = model_spec_with(config.model, train_set.input(), config.lstm);
    let test_set = match config.scoring.examples {
        Some(n) if n < test_set.len() => test_set.subset(&sample(test_set.len(), n, config.seed)),
        _ => test_set,
    };
    let admin = AdminClient::with_tls(&config.url, &config.operator_token, &config.tls)?;
    let name = format!(
        "simulate-{:?}-{:?}-{}",
        config.dataset,
        config.model,
        hex_suffix().map_err(SimulationError::Invalid)?
    )
    .to_lowercase();
    let population = config.population.clone().unwrap_or_else(|| name.clone());
    // Its devices may join only its population; a few uses spare for enrollments retried
    // after a lost answer.
    let uses = config.clients as i64 + 8;
    let token = admin.enrollment_token_for(uses, &[population.as_str()]).await?.token;
    let plan = simulation_plan(&config, &name, &population, &spec);
    // The run's own accountant, for the ε each committed model has spent.
    let privacy = serde_json::from_value::<starling_core::plan::Plan>(plan.clone())
        .map_err(|e| SimulationError::Invalid(format!("the simulation's plan: {e}")))?
        .validate()
        .map_err(|e| SimulationError::Invalid(format!("the simulation's plan: {e}")))?
        .privacy()
        .copied();
    let started = std::time::Instant::now();
    // The store refuses the run while another trains the population (a constraint, so two
    // simulations cannot both take it).
    let run = match admin.create_run(&plan).await {
        Ok(view) => RunId(view.id),
        Err(ClientError::Api { body, .. }) if body.code == ErrorCode::Conflict => {
            return Err(SimulationError::PopulationBusy { population, why: body.message });
        }
        Err(e) => return Err(e.into()),
    };
    let roster = config
        .seeded_cohorts
        .then(|| Arc::new(Roster::new(config.seed, config.clients, config.cohort as usize)));
    let mut fleet = Fleet::spawn(&config, &population, &token, &train_set, parts, roster.clone())?;
    // Seeded cohorts follow the run's open round, watched apart from scoring so that a slow
    // score never holds up training.
    let following = roster.map(|roster| tokio::spawn(roster.follow(admin.clone(), run)));
    // Observe: evaluate each committed model on the test set, and report it as the central
    // evaluation of the "simulator".
    let evaluator = CentralEvaluator::new(
        admin.clone(),
        run,
        SIMULATOR_EVALUATOR,
        spec.clone(),
        test_set,
        config.backend.clone(),
    )
    .map_err(|e| SimulationError::Participant(e.to_string()))?;
    let mut observed = Observed {
        results: vec![],
        seen: 0,
        not_evaluated: vec![],
        failed: vec![],
        scoring: config.scoring,
        privacy,
        started,
        timeout: config.timeout,
        target: config.target,
    };
    let outcome = observed.watch(&admin, run, &evaluator, &mut fleet, on_round, on_failed).await;
    if let Some(following) = following {
        following.abort();
    }
    let devices = fleet.stop();
    let Observed { results, not_evaluated, failed, .. } = observed;
    outcome.map(|()| SimulationReport {
        run_id: run,
        population,
        devices,
        rounds: results,
        not_evaluated,
        failed_rounds: failed,
    })
}

/// The simulation's plan: the model, its training and pacing, and what the config turns on.
fn simulation_plan(
    config: &SimulationConfig,
    name: &str,
    population: &str,
    spec: &ModelSpec,
) -> serde_json::Value {
    let mut pacing = config.pacing;
    let mut training = config.training.clone();
    if training.get("seed").is_none() && training.is_object() {
        // Batch orders follow the simulation's seed.
        training["seed"] = config.seed.into();
    }
    if config.seeded_cohorts {
        // The simulator draws each cohort: exactly those clients check in, all are taken and
        // every one must report.
        pacing.over_selection = 1.0;
        pacing.min_quorum = Some(config.cohort);
    }
    let mut plan = serde_json::json!({
        "name": name,
        "population": population,
        // Trains its population alone: the store refuses the run if another runs there (two
        // simulations checking first could both pass the check).
        "exclusive_population": true,
        "model": {"spec": spec, "init": {"kind": "seeded", "seed": config.seed}},
        "training": training,
        "cohort_size": config.cohort,
        "over_selection": pacing.over_selection,
        "min_quorum": pacing.min_quorum.unwrap_or((config.cohort * 4 / 5).max(1)),
        "selection_timeout_secs": pacing.selection_timeout_secs,
        "reporting_timeout_secs": pacing.reporting_timeout_secs,
        "rounds": config.rounds,
        "selection": config.selection,
        "compression": config.compression,
        "model_download": config.model_download,
    });
    if config.seeded_cohorts {
        plan["selection"] = "first_come".into();
    }
    if !config.strategy.is_null() {
        plan["strategy"] = config.strategy.clone();
    }
    if let Some(a) = &config.asynchronous {
        plan["asynchronous"] = serde_json::to_value(a).expect("settings serialize");
    }
    if config.checkpoint_interval != 1 {
        plan["checkpoint_interval"] = config.checkpoint_interval.into();
    }
    if config.secure {
        // Deltas of these models stay well inside ±1 (weighted by examples / max_examples);
        // with DP every update weighs the same.
        let dp = !config.strategy["differential_privacy"].is_null();
        plan["secure_aggregation"] = serde_json::json!({
            "clip": 1.0,
            "max_examples": if dp { 1 } else { 10_000 },
            "stage_timeout_secs": 10.0,
        });
    }
    plan
}

/// The simulated devices, each a task that enrolls and participates until stopped.
struct Fleet {
    tasks: Vec<tokio::task::JoinHandle<Result<(), String>>>,
    stop: Arc<AtomicBool>,
    enrolled: Arc<std::sync::Mutex<Vec<DeviceId>>>,
}

impl Fleet {
    /// One device per client's part of `train_set`, the attackers and slow devices among them
    /// as the config says.
    fn spawn(
        config: &SimulationConfig,
        population: &str,
        token: &str,
        train_set: &Examples,
        parts: Vec<Vec<usize>>,
        roster: Option<Arc<Roster>>,
    ) -> Result<Self, SimulationError> {
        let attackers = config.poisoning.map_or(0, |p| p.attackers(config.clients));
        let slow_devices = |s: &Slowdown| s.slow_devices(config.clients);
        let stop = Arc::new(AtomicBool::new(false));
        let enrolled = Arc::new(std::sync::Mutex::new(vec![]));
        let slots = TrainingSlots::one_per_core()
            .map_err(|e| SimulationError::Invalid(format!("no training threads: {e}")))?;
        let mut tasks = vec![];
        for (i, idx) in parts.into_iter().enumerate() {
            let local = train_set.subset(&idx);
            let (local_train, local_holdout) =
                local.split_holdout(config.holdout, config.seed + i as u64);
            let mut participant = Participant::new(
                &config.url,
                population,
                local_train,
                local_holdout,
                config.backend.training_device(),
            )
            .with_tls(&config.tls)?
            .sharing_cores(slots.clone());
            if let Some(p) = config.poisoning.filter(|_| i < attackers) {
                participant = participant.tampering(Arc::new(move |delta| p.attack.apply(delta)));
            }
            if let Some(slow) = config.slowdown.filter(|s| i >= config.clients - slow_devices(s)) {
                participant = participant.slowed(slow.factor);
            }
            if roster.is_some() {
                // Training seeds from the simulation's seed, the client and the round only.
                participant = participant.seeded_as(i as u64);
            }
            let (token, stop) = (token.to_owned(), stop.clone());
            let (enrolled, roster) = (enrolled.clone(), roster.clone());
            tasks.push(tokio::spawn(async move {
                let device = participant.enroll(&token).await.map_err(|e| e.to_string())?;
                enrolled.lock().expect("no task panics holding it").push(device);
                // With seeded cohorts: the last round this client took part in.
                let mut done: Option<i64> = None;
                while !stop.load(Ordering::Relaxed) {
                    if let Some(roster) = &roster
                        && !roster.due(i, done)
                    {
                        tokio::time::sleep(Roster::POLL).await;
                        continue;
                    }
                    match participant.participate(Box::new(|_| {})).await {
                        Ok(Outcome::ComeBackLater(d)) => {
                            let most = if roster.is_some() {
                                Roster::POLL
                            } else {
                                Duration::from_secs(1)
                            };
                            tokio::time::sleep(d.min(most)).await
                        }
                        Ok(
                            Outcome::Uploaded { round_idx, .. }
                            | Outcome::Evaluated { round_idx, .. }
                            | Outcome::RoundMissed { round_idx, .. }
                            | Outcome::ConditionsNotMet { round_idx, .. },
                        ) => done = Some(round_idx.0),
                        Err(e) => {
                            tracing::warn!(client = i, error = %e, "participation failed");
                            tokio::time::sleep(Duration::from_millis(500)).await;
                        }
                    }
                }
                Ok::<_, String>(())
            }));
        }
        Ok(Fleet { tasks, stop, enrolled })
    }

    /// A device task's error, once one has ended.
    async fn failed(&mut self) -> Option<String> {
        let ended = self.tasks.iter().position(|t| t.is_finished())?;
        self.tasks.remove(ended).await.expect("participant task panicked").err()
    }

    /// Stops every device; the devices that enrolled, sorted.
    fn stop(self) -> Vec<DeviceId> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.abort();
        }
        let mut devices = self.enrolled.lock().expect("no task panics holding it").clone();
        devices.sort();
        devices
    }
}

/// Each round's cohort drawn from the simulation's seed, and the round the run has open.
struct Roster {
    seed: u64,
    clients: usize,
    cohort: usize,
    /// The run's open round, as last seen (−1: none yet).
    open: std::sync::atomic::AtomicI64,
}

impl Roster {
    /// How often clients and the watcher look again.
    const POLL: Duration = Duration::from_millis(50);

    fn new(seed: u64, clients: usize, cohort: usize) -> Self {
        Roster { seed, clients, cohort, open: std::sync::atomic::AtomicI64::new(-1) }
    }

    /// Round `round`'s cohort: `cohort` of the clients, drawn from the seed and the round.
    fn cohort(&self, round: i64) -> Vec<usize> {
        let mut rng = starling_core::rng::SplitMix64(self.seed);
        rng.0 = rng.next_u64() ^ round as u64;
        let mut clients: Vec<usize> = (0..self.clients).collect();
        rng.choose(&mut clients, self.cohort);
        clients
    }

    /// Whether client `i`, which last took part in round `done`, should check in now: the open
    /// round is newer and drew it.
    fn due(&self, i: usize, done: Option<i64>) -> bool {
        let open = self.open.load(Ordering::Relaxed);
        open >= 0 && done.is_none_or(|d| open > d) && self.cohort(open).contains(&i)
    }

    /// Keeps `open` at the run's open round until aborted.
    async fn follow(self: Arc<Self>, admin: AdminClient, run: RunId) {
        loop {
            if let Ok(rounds) = admin.rounds(run).await
                && let Some(open) =
                    rounds.iter().filter(|r| r.state == "open").map(|r| r.round_idx).max()
            {
                self.open.store(open, Ordering::Relaxed);
            }
            tokio::time::sleep(Self::POLL).await;
        }
    }
}

/// `n` distinct indices below `len`, drawn from `seed`, sorted.
fn sample(len: usize, n: usize, seed: u64) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..len).collect();
    starling_core::rng::SplitMix64(seed ^ 0x5c0_12e5).choose(&mut idx, n);
    idx.sort_unstable();
    idx
}

/// What the simulation saw of its run's models.
struct Observed {
    results: Vec<RoundResult>,
    /// The newest version evaluated or passed over.
    seen: i64,
    /// Versions passed over (given up by the checkpoint interval before they were reached).
    not_evaluated: Vec<i64>,
    /// Which versions are scored.
    scoring: Scoring,
    /// The run's privacy, for ε per model.
    privacy: Option<starling_core::privacy::Privacy>,
    /// Rounds seen failed, in order.
    failed: Vec<FailedRound>,
    /// When the run was created.
    started: std::time::Instant,
    /// The simulation's time limit.
    timeout: Option<Duration>,
    /// The test accuracy at which the run is stopped, done.
    target: Option<f64>,
}

impl Observed {
    /// Evaluates each model `run` commits, in order, until the run ends or a device fails.
    async fn watch(
        &mut self,
        admin: &AdminClient,
        run: RunId,
        evaluator: &CentralEvaluator,
        fleet: &mut Fleet,
        mut on_round: impl FnMut(&RoundResult),
        mut on_failed: impl FnMut(&FailedRound),
    ) -> Result<(), SimulationError> {
        if self.scoring.initial {
            // The curve's round-0 row: the model before any round.
            let models = admin.models(run).await?;
            if let Some(v0) = models.iter().find(|m| m.version == 0)
                && let Some(eval) = evaluator
                    .evaluate_version(0)
                    .await
                    .map_err(|e| SimulationError::Participant(e.to_string()))?
            {
                let result = RoundResult {
                    version: 0,
                    test_accuracy: eval.accuracy,
                    test_loss: eval.loss,
                    train_loss: None,
                    reported: Some(0),
                    dropped: Some(0),
                    elapsed_secs: self.started.elapsed().as_secs_f64(),
                    round_secs: None,
                    upload_bytes: None,
                    epsilon: self.privacy.map(|_| 0.0),
                    content_hash: v0.content_hash.clone(),
                };
                on_round(&result);
                self.results.push(result);
            }
        }
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            // The view first: if it shows the run ended, the models read after it are all of
            // them.
            let view = admin.run(run).await?;
            let models = admin.models(run).await?;
            let rounds = admin.rounds(run).await?;
            let total = i64::from(view.total_rounds);
            // Each failed round is said as it fails, with why: 84 failed in a row once with
            // nothing printed.
            for r in rounds.iter().filter(|r| r.state == "failed") {
                if self.failed.iter().any(|f| f.round_idx == r.round_idx) {
                    continue;
                }
                let outcome = r.outcome.as_ref().map_or("failed".to_owned(), outcome_text);
                let failed = FailedRound { round_idx: r.round_idx, outcome };
                on_failed(&failed);
                self.failed.push(failed);
            }
            if let Some(limit) = self.timeout.filter(|&t| self.started.elapsed() > t) {
                // Not one more round: the run is stopped, and the failure says how far it got.
                let _ = admin.stop(run).await;
                let summary = self.summary(&view);
                return Err(SimulationError::TimedOut { secs: limit.as_secs_f64(), summary });
            }
            let newer = models.iter().position(|m| m.version > self.seen).unwrap_or(models.len());
            for m in &models[newer..] {
                self.seen = m.version;
                if !self.scoring.scores(m.version, total) {
                    continue;
                }
                let Some(eval) = evaluator
                    .evaluate_version(m.version)
                    .await
                    .map_err(|e| SimulationError::Participant(e.to_string()))?
                else {
                    self.not_evaluated.push(m.version);
                    continue;
                };
                let round = rounds.iter().find(|r| Some(r.round_idx) == m.round_idx);
                // A run that hides its cohort sizes shows neither count.
                let counted = round.is_none_or(|r| r.n_reported.is_some());
                let result = RoundResult {
                    version: m.version,
                    test_accuracy: eval.accuracy,
                    test_loss: eval.loss,
                    train_loss: round.and_then(|r| r.metrics.as_ref()?.get("loss").copied()),
                    reported: counted.then(|| round.and_then(|r| r.n_reported).unwrap_or(0)),
                    dropped: counted.then(|| round.and_then(|r| r.n_dropped).unwrap_or(0)),
                    elapsed_secs: self.started.elapsed().as_secs_f64(),
                    round_secs: round
                        .and_then(|r| Some((r.closed_at_ms? - r.opened_at_ms) as f64 / 1000.0)),
                    upload_bytes: round.and_then(|r| r.upload_bytes),
                    epsilon: self.privacy.map(|p| p.epsilon_after(m.version.max(0) as u64)),
                    content_hash: m.content_hash.clone(),
                };
                let reached = self.target.is_some_and(|t| result.test_accuracy >= t);
                on_round(&result);
                self.results.push(result);
                if reached {
                    // Done: the run is stopped here rather than trained on to its last round.
                    admin.stop(run).await?;
                    return Ok(());
                }
            }
            if view.status != "running" && self.seen == view.model_version {
                return match view.status.as_str() {
                    "finished" => Ok(()),
                    _ => Err(SimulationError::RunEnded {
                        summary: self.summary(&view),
                        status: view.status,
                        reason: view.stop_reason,
                    }),
                };
            }
            if let Some(e) = fleet.failed().await {
                return Err(SimulationError::Participant(e));
            }
        }
    }
}

impl Observed {
    /// How far the run got: its committed and failed rounds, the last failure, the time.
    fn summary(&self, view: &starling_core::admin::RunView) -> String {
        let last = self.failed.last().map(|f| format!(" (the last: {})", f.outcome));
        format!(
            "{} of {} rounds committed, {} failed{} in {:.0} s",
            view.rounds_committed,
            view.total_rounds,
            self.failed.len(),
            last.unwrap_or_default(),
            self.started.elapsed().as_secs_f64()
        )
    }
}

/// A round's outcome as one line: its name and counts (`too_few_reports, reported 2, quorum 8`).
fn outcome_text(outcome: &serde_json::Value) -> String {
    let Some(fields) = outcome.as_object() else { return outcome.to_string() };
    let name = fields.get("outcome").and_then(|v| v.as_str()).unwrap_or("failed");
    let counts: Vec<String> = fields
        .iter()
        .filter(|(k, _)| k.as_str() != "outcome")
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    std::iter::once(name.to_owned()).chain(counts).collect::<Vec<_>>().join(", ")
}

/// Eight random hex digits, so that two simulations' runs and populations never share a name.
fn hex_suffix() -> Result<String, String> {
    let mut bytes = [0u8; 4];
    getrandom::fill(&mut bytes).map_err(|e| format!("the OS random source failed: {e}"))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests;

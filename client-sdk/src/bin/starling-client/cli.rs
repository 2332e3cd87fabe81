//! The SDK's command line, for Linux/IoT devices (`participate`: one device training on a local
//! directory of examples) and for operators (`simulate`: many devices against a coordinator;
//! `evaluate`: central evaluation of a run's models).
//! It lives in the library so that tests run the same code as the binary.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use starling_core::RunId;
use starling_core::model_spec::InputSpec;

use starling_client::backend::{self, BackendChoice};
use starling_client::data;
use starling_client::data::{Dataset, Partition};
use starling_client::evaluate::{EvaluatorConfig, evaluate_run};
use starling_client::participant::{Outcome, Participant, ParticipantError, ParticipantState};
use starling_client::protocol::TlsSettings;
use starling_client::simulate::{
    Attack, ModelKind, Pacing, Poisoning, Preset, RoundResult, Scoring, Settings, SimulationConfig,
    simulate_reporting,
};

#[derive(Debug, Parser)]
#[command(name = "starling-client", version, about = "Starling client SDK tools")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run N real SDK clients against a coordinator and print the global model's test accuracy
    /// round by round.
    Simulate(Box<SimulateArgs>),
    /// Take part in training as this device: enroll once (the credential is kept in --state),
    /// then check in, train on the local examples and upload, round after round.
    Participate(ParticipateArgs),
    /// Evaluate every committed model of a run on a held-out set (central evaluation) and
    /// report the metrics through the admin API, following the run until it ends.
    Evaluate(EvaluateArgs),
}

#[derive(Debug, clap::Args)]
struct EvaluateArgs {
    /// Coordinator URL.
    #[arg(long, env = "STARLING_URL", default_value = "http://127.0.0.1:8080")]
    url: String,
    /// Operator token (models are downloaded and evaluations reported through the admin API).
    #[arg(long, env = "STARLING_OPERATOR_TOKEN", hide_env_values = true)]
    operator_token: String,
    /// The run.
    #[arg(long)]
    run: i64,
    /// The held-out set: this dataset's test split.
    #[arg(long, value_enum)]
    dataset: Dataset,
    /// The shared data folder.
    #[arg(long, env = "STARLING_DATA_DIR", default_value = "../shared/data")]
    data_dir: PathBuf,
    /// Seed of the digits' 80/20 split (the simulator's --seed gives the simulator's test set).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The name the evaluations are reported under.
    #[arg(long, default_value = "central")]
    name: String,
    /// Evaluate the models committed so far and stop, rather than follow the run to its end.
    #[arg(long)]
    once: bool,
    /// Where to evaluate: `auto`, `wgpu` or `cpu`.
    #[arg(long, env = "STARLING_BACKEND", default_value = "auto")]
    backend: BackendChoice,
    #[command(flatten)]
    tls: TlsArgs,
}

#[derive(Debug, clap::Args)]
struct ParticipateArgs {
    /// Coordinator URL.
    #[arg(long, env = "STARLING_URL", default_value = "http://127.0.0.1:8080")]
    url: String,
    /// Operator-issued enrollment token; needed only until the device is enrolled.
    #[arg(long, env = "STARLING_ENROLLMENT_TOKEN", hide_env_values = true)]
    enrollment_token: Option<String>,
    /// The device's state file (credential, last evaluated model); created on enrollment.
    #[arg(long, default_value = "starling-device.json")]
    state: PathBuf,
    /// The local examples: a directory holding `images-idx3-ubyte` and `labels-idx1-ubyte`
    /// (IDX, as MNIST), or a CSV file of `label,x1,...,xn` rows (see --input).
    #[arg(long)]
    examples: PathBuf,
    /// For a CSV file: the input, `features:N` or `image:C:H:W`.
    #[arg(long)]
    input: Option<String>,
    /// Scale for IDX pixel bytes.
    #[arg(long, default_value_t = 1.0 / 255.0)]
    pixel_scale: f32,
    /// Fraction of the examples held out to evaluate the global model on.
    #[arg(long, default_value_t = 0.1)]
    holdout: f64,
    /// Device population.
    #[arg(long, default_value = "default")]
    population: String,
    /// Check in again after at most this many seconds, whatever later time the coordinator
    /// suggests.
    #[arg(long, default_value_t = 60)]
    max_wait_secs: u64,
    /// Stop after this many acknowledged uploads (0: until interrupted).
    #[arg(long, default_value_t = 0)]
    uploads: u32,
    /// Where to train: `auto` (wgpu on a GPU, else CPU), `wgpu` or `cpu`.
    #[arg(long, env = "STARLING_BACKEND", default_value = "auto")]
    backend: BackendChoice,
    #[command(flatten)]
    tls: TlsArgs,
}

/// How to verify an `https://` coordinator, and the device's own certificate for mutual TLS.
#[derive(Debug, clap::Args)]
struct TlsArgs {
    /// PEM CA certificate(s) the coordinator's certificate must chain to (default: the
    /// system's trust store).
    #[arg(long, env = "STARLING_CA_CERT")]
    ca_cert: Option<PathBuf>,
    /// PEM device certificate, for a coordinator that requires mutual TLS.
    #[arg(long, env = "STARLING_CLIENT_CERT", requires = "client_key")]
    client_cert: Option<PathBuf>,
    /// PEM private key of --client-cert.
    #[arg(long, env = "STARLING_CLIENT_KEY", requires = "client_cert")]
    client_key: Option<PathBuf>,
}

impl TlsArgs {
    fn settings(&self) -> anyhow::Result<TlsSettings> {
        Ok(TlsSettings::from_files(
            self.ca_cert.as_deref(),
            self.client_cert.as_deref(),
            self.client_key.as_deref(),
        )?)
    }
}

#[derive(Debug, clap::Args)]
struct SimulateArgs {
    /// Coordinator URL.
    #[arg(long, env = "STARLING_URL", default_value = "http://127.0.0.1:8080")]
    url: String,
    /// Operator token (the simulator creates the run).
    #[arg(long, env = "STARLING_OPERATOR_TOKEN", hide_env_values = true)]
    operator_token: String,
    /// Simulated devices.
    #[arg(long)]
    clients: Option<usize>,
    /// Reports per round [default: half the clients].
    #[arg(long)]
    cohort: Option<u32>,
    /// Rounds to commit [default: 15].
    #[arg(long)]
    rounds: Option<u32>,
    /// Dataset [default: digits].
    #[arg(long, value_enum)]
    dataset: Option<Dataset>,
    /// The shared data folder.
    #[arg(long, env = "STARLING_DATA_DIR", default_value = "../shared/data")]
    data_dir: PathBuf,
    /// iid, dirichlet:ALPHA or shards:N [default: iid].
    #[arg(long)]
    partition: Option<Partition>,
    /// Model [default: mlp].
    #[arg(long, value_enum)]
    model: Option<ModelKind>,
    /// Local epochs (the FedAvg paper's E) [default: 5].
    #[arg(long)]
    epochs: Option<u32>,
    /// Local batch size (the FedAvg paper's B) [default: 10].
    #[arg(long)]
    batch_size: Option<u32>,
    /// Local learning rate [default: 0.1].
    #[arg(long)]
    lr: Option<f64>,
    /// Start from the FedAvg paper's MNIST settings (100 clients of 600 examples, 10 per
    /// round, B = 10, no holdout; the 2NN at E = 1, the CNN at E = 5); flags given beside it
    /// override it.
    #[arg(long, value_enum)]
    preset: Option<Preset>,
    /// Seed of the data split, the initial model and batch orders. Given, the run repeats bit
    /// for bit: the simulator draws each round's cohort from it too (exactly --cohort clients,
    /// all of which must report); with DP or --asynchronous the coordinator still draws the
    /// cohorts [default: 1, cohorts drawn by the coordinator].
    #[arg(long, conflicts_with = "seeds")]
    seed: Option<u64>,
    /// Run the same setting once per seed (each repeatable, as --seed), and report the mean and
    /// spread of the rounds each took to reach --target.
    #[arg(long, value_delimiter = ',', requires = "target")]
    seeds: Option<Vec<u64>>,
    /// Stop the run once a scored model reaches this test accuracy (0 to 1), and end there;
    /// with --seeds, the round each seed first reached it is reported.
    #[arg(long)]
    target: Option<f64>,
    /// FedProx's proximal weight μ on the devices' local objective [default: 0, FedAvg].
    #[arg(long)]
    fedprox_mu: Option<f64>,
    /// The devices' local optimizer: sgd or adam [default: sgd].
    #[arg(long, value_parser = parse_local_optimizer)]
    local_optimizer: Option<starling_core::plan::LocalOptimizer>,
    /// Stacked LSTM layers of the Shakespeare model [default: 1; the paper's preset 2].
    #[arg(long)]
    lstm_layers: Option<u32>,
    /// Units per LSTM layer [default: 64; the paper's preset 256].
    #[arg(long)]
    lstm_hidden: Option<u32>,
    /// Width of the Shakespeare model's character embedding [default: 8].
    #[arg(long)]
    embedding_dim: Option<u32>,
    /// Training windows (80 characters and the next) per Shakespeare role, at most; 0 for all
    /// of each role's text [default: 400; the paper's preset 0].
    #[arg(long)]
    windows_per_role: Option<usize>,
    /// Roles whose held-out tenth makes the Shakespeare test set [default: 64].
    #[arg(long)]
    test_roles: Option<usize>,
    /// Score every K-th committed model (and the last) on the test set.
    #[arg(long, default_value_t = 1)]
    eval_every: u32,
    /// Score on this many test examples (a seeded sample) instead of the whole test set.
    #[arg(long)]
    eval_examples: Option<usize>,
    /// Train with differential privacy at this ε over the run's rounds: the noise multiplier is
    /// the smallest the run's own accountant allows (with --delta; the population is the
    /// clients, the clip norm --clip-norm).
    #[arg(long, requires = "delta")]
    epsilon: Option<f64>,
    /// δ of --epsilon.
    #[arg(long, requires = "epsilon")]
    delta: Option<f64>,
    /// The L2 norm each update is clipped to, with --epsilon.
    #[arg(long, default_value_t = 1.0, requires = "epsilon")]
    clip_norm: f64,
    /// Use at most this many training examples (0: all).
    #[arg(long, default_value_t = 0)]
    max_examples: usize,
    /// Aggregate with SecAgg+ secure aggregation (the coordinator sees only masked inputs).
    #[arg(long)]
    secure: bool,
    /// The device population the run trains [default: one of the simulation's own, named after
    /// its run]. Refused while another run trains it: its devices would join that run too.
    #[arg(long)]
    population: Option<String>,
    /// Devices selected per round, as a multiple of the cohort [default: 1.3].
    #[arg(long)]
    over_selection: Option<f64>,
    /// Fewest reports a round commits with [default: 80 % of the cohort].
    #[arg(long)]
    min_quorum: Option<u32>,
    /// Longest time a round selects devices, in seconds.
    #[arg(long, default_value_t = Pacing::default().selection_timeout_secs)]
    selection_timeout_secs: f64,
    /// Longest time from a round's opening to its close, in seconds; it must cover local
    /// training [default: 120].
    #[arg(long)]
    reporting_timeout_secs: Option<f64>,
    /// Fraction of each device's examples held out for federated evaluation (0: train on all)
    /// [default: 0.1].
    #[arg(long)]
    holdout: Option<f64>,
    /// The plan's strategy as JSON, or @FILE: server optimizer, robust aggregation, differential
    /// privacy, e.g. '{"optimizer": {"kind": "fed_adam", "lr": 0.01}}' [default: FedAvg].
    #[arg(long)]
    strategy: Option<String>,
    /// How each round's cohort is drawn: `random`, `first_come` or `poisson` (with DP).
    #[arg(long, default_value = "random", value_parser = parse_selection)]
    selection: starling_core::plan::SelectionPolicy,
    /// Make some devices poison their updates: `scale:FACTOR` (a boosted delta) or
    /// `sign_flip[:FACTOR]` (a reversed one), for measuring robust aggregation.
    #[arg(long)]
    attack: Option<Attack>,
    /// The encoding devices upload their deltas in: f32, f16, bf16, int8[:BLOCK] or
    /// top_k:FRACTION.
    #[arg(long, default_value = "f32")]
    compression: starling_core::compression::Compression,
    /// The encoding devices download the model in: f32, f16, bf16 or int8[:BLOCK] (rounded to
    /// nearest; the coordinator keeps the model in full precision).
    #[arg(long, default_value = "f32")]
    model_download: starling_core::compression::Compression,
    /// Share of the devices that attack, with --attack.
    #[arg(long, default_value_t = 0.1, requires = "attack")]
    attackers: f64,
    /// Aggregate asynchronously (FedBuff): `CONCURRENCY:MAX_STALENESS[:EXPONENT]` devices train
    /// at once, updates up to MAX_STALENESS versions behind count, weighted (1 + s)^-EXPONENT
    /// (0.5 by default), and a model is committed every --cohort updates.
    #[arg(long, value_parser = parse_asynchronous)]
    asynchronous: Option<starling_core::plan::AsynchronousPlan>,
    /// Make a share of the devices slow: `FRACTION:FACTOR`, e.g. 0.2:5 (a fifth of them take
    /// five times as long to train).
    #[arg(long)]
    slow: Option<starling_client::simulate::Slowdown>,
    /// Write the run's model bytes every N versions and its last (the plan's
    /// `checkpoint_interval`): the versions between are not kept.
    #[arg(long, default_value_t = 1)]
    checkpoint_interval: u32,
    /// Where to train: `auto` (wgpu on a GPU, else CPU), `wgpu` (any adapter, lavapipe included) or `cpu`.
    #[arg(long, env = "STARLING_BACKEND", default_value = "auto")]
    backend: BackendChoice,
    #[command(flatten)]
    tls: TlsArgs,
    /// Write the curve here as each model is scored (`.json` for JSON, anything else CSV);
    /// with --seeds one file per seed (`NAME-seedN.csv`) and the summary in `NAME-summary.csv`.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Give the whole simulation at most this many seconds: past them its run is stopped and
    /// the simulator exits non-zero with what it got done [default: no limit].
    #[arg(long, value_parser = parse_timeout)]
    timeout: Option<std::time::Duration>,
}

/// `--local-optimizer`: `sgd` or `adam`.
fn parse_local_optimizer(s: &str) -> Result<starling_core::plan::LocalOptimizer, String> {
    serde_json::from_value(serde_json::Value::String(s.to_owned()))
        .map_err(|_| format!("{s:?} is not a local optimizer: sgd or adam"))
}

/// A `--timeout` in seconds: positive and at most a year.
fn parse_timeout(s: &str) -> Result<std::time::Duration, String> {
    let secs: f64 = s.parse().map_err(|e| format!("{s:?} is not a number of seconds: {e}"))?;
    if !(secs > 0.0 && secs <= 365.0 * 86_400.0) {
        return Err(format!("{secs} s is not in (0, one year]"));
    }
    Ok(std::time::Duration::from_secs_f64(secs))
}

/// The `starling-client` binary.
pub(crate) fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    match cli.command {
        Command::Simulate(args) => run_simulation(&runtime, *args),
        Command::Participate(args) => runtime.block_on(participate(args)),
        Command::Evaluate(args) => runtime.block_on(central_evaluation(args)),
    }
}

async fn central_evaluation(args: EvaluateArgs) -> anyhow::Result<()> {
    let config = EvaluatorConfig {
        url: args.url,
        operator_token: args.operator_token,
        tls: args.tls.settings()?,
        run: RunId(args.run),
        name: args.name,
        dataset: args.dataset,
        data_dir: args.data_dir,
        seed: args.seed,
        backend: backend::select(args.backend)?,
        follow: !args.once,
    };
    println!(
        "evaluating run {} on {:?}'s held-out set as {:?}",
        config.run, config.dataset, config.name
    );
    let evaluated = evaluate_run(config, |version, e| {
        println!(
            "model {version}: accuracy {:.2}%, loss {:.4} on {} examples",
            e.accuracy * 100.0,
            e.loss,
            e.examples
        );
        let _ = std::io::stdout().flush();
    })
    .await?;
    println!("{evaluated} models evaluated");
    Ok(())
}

async fn participate(args: ParticipateArgs) -> anyhow::Result<()> {
    let input = args.input.as_deref().map(parse_input).transpose()?;
    let examples = data::local_examples(&args.examples, input, args.pixel_scale)
        .with_context(|| format!("reading examples from {}", args.examples.display()))?;
    anyhow::ensure!(!examples.is_empty(), "{} holds no examples", args.examples.display());
    let (train_set, holdout) = examples.split_holdout(args.holdout, 0);
    let backend = backend::select(args.backend)?;
    println!(
        "{} local examples ({} held out), training on {backend}",
        examples.len(),
        holdout.len()
    );
    let mut device = Participant::new(
        &args.url,
        &args.population,
        train_set,
        holdout,
        backend.training_device(),
    )
    .with_tls(&args.tls.settings()?)?
    .keeping_state_in(&args.state);
    match ParticipantState::load(&args.state)?.filter(|s| s.credential.is_some()) {
        Some(state) => {
            if let Some(pending) = &state.pending_upload {
                println!(
                    "run {} round {}: sending the update trained before the last stop first",
                    pending.run_id, pending.round_idx
                );
            }
            device = device.restore(state)
        }
        None => {
            let token = args.enrollment_token.as_deref().context(
                "this device is not enrolled yet: pass --enrollment-token (or STARLING_ENROLLMENT_TOKEN)",
            )?;
            let id = device.enroll(token).await?;
            device.state().save(&args.state)?;
            println!("enrolled as device {id}; credential saved in {}", args.state.display());
        }
    }
    let mut uploads = 0;
    let mut failures = 0u32;
    while args.uploads == 0 || uploads < args.uploads {
        match device.participate(Box::new(|_| {})).await {
            Ok(Outcome::ComeBackLater(after)) => {
                failures = 0;
                tokio::time::sleep(after.min(Duration::from_secs(args.max_wait_secs))).await;
            }
            Ok(Outcome::Uploaded { run_id, round_idx, train_loss, evaluation }) => {
                failures = 0;
                uploads += 1;
                let eval = evaluation.map_or(String::new(), |e| {
                    format!(", global model on held-out data: accuracy {:.2}%", e.accuracy * 100.0)
                });
                println!(
                    "run {run_id} round {round_idx}: uploaded, training loss {train_loss:.4}{eval}"
                );
            }
            Ok(Outcome::Evaluated { run_id, round_idx, evaluation: e }) => {
                failures = 0;
                uploads += 1;
                println!(
                    "run {run_id} round {round_idx}: evaluated on {} local examples, accuracy {:.2}%, loss {:.4}",
                    e.examples,
                    e.accuracy * 100.0,
                    e.loss
                );
            }
            Ok(Outcome::RoundMissed { run_id, round_idx }) => {
                println!("run {run_id} round {round_idx}: closed before the update arrived");
            }
            Ok(Outcome::ConditionsNotMet { run_id, round_idx, unmet }) => {
                // A command-line device reports no conditions, so this needs a plan whose
                // requirements it cannot meet; say which, and wait as for any other no.
                println!(
                    "run {run_id} round {round_idx}: left, the device does not meet {}",
                    unmet.join(", ")
                );
                tokio::time::sleep(Duration::from_secs(args.max_wait_secs)).await;
            }
            Err(ParticipantError::Protocol(e)) if e.is_transient() => {
                failures += 1;
                let wait = Duration::from_secs(2u64.pow(failures.min(5)));
                eprintln!("coordinator unreachable ({e}); retrying in {wait:?}");
                tokio::time::sleep(wait).await;
            }
            Err(e) => return Err(e.into()),
        }
        device.state().save(&args.state)?;
    }
    Ok(())
}

/// `features:N` or `image:C:H:W`.
fn parse_input(text: &str) -> anyhow::Result<InputSpec> {
    let parts: Vec<&str> = text.split(':').collect();
    let num =
        |s: &str| s.parse::<u64>().with_context(|| format!("{s:?} in --input is not a count"));
    match parts.as_slice() {
        ["features", n] => Ok(InputSpec::Features { size: num(n)? }),
        ["image", c, h, w] => {
            Ok(InputSpec::Image { channels: num(c)?, height: num(h)?, width: num(w)? })
        }
        _ => anyhow::bail!("--input {text:?}: expected features:N or image:C:H:W"),
    }
}

fn parse_asynchronous(text: &str) -> Result<starling_core::plan::AsynchronousPlan, String> {
    let parts: Vec<&str> = text.split(':').collect();
    let number = |i: usize| -> Result<u32, String> {
        parts[i].parse().map_err(|e| format!("{:?} in {text:?}: {e}", parts[i]))
    };
    if !(2..=3).contains(&parts.len()) {
        return Err(format!("{text:?} is not CONCURRENCY:MAX_STALENESS[:EXPONENT]"));
    }
    let staleness_exponent = match parts.get(2) {
        None => 0.5,
        Some(e) => e.parse().map_err(|err| format!("exponent {e:?}: {err}"))?,
    };
    Ok(starling_core::plan::AsynchronousPlan {
        concurrency: number(0)?,
        max_staleness: number(1)?,
        staleness_exponent,
    })
}

fn parse_selection(text: &str) -> Result<starling_core::plan::SelectionPolicy, String> {
    serde_json::from_value(serde_json::Value::String(text.to_owned()))
        .map_err(|_| format!("{text:?} is not a selection policy: random, first_come or poisson"))
}

fn run_simulation(runtime: &tokio::runtime::Runtime, args: SimulateArgs) -> anyhow::Result<()> {
    let settings = settings(&args);
    let seeds = args.seeds.clone().unwrap_or_else(|| vec![args.seed.unwrap_or(1)]);
    let mut strategy = match &args.strategy {
        None => serde_json::Value::Null,
        Some(text) => {
            let text = match text.strip_prefix('@') {
                Some(path) => std::fs::read_to_string(path)
                    .with_context(|| format!("reading the strategy from {path}"))?,
                None => text.clone(),
            };
            serde_json::from_str(&text).context("--strategy is not JSON")?
        }
    };
    if let (Some(epsilon), Some(delta)) = (args.epsilon, args.delta) {
        anyhow::ensure!(
            strategy["differential_privacy"].is_null(),
            "--epsilon and a differential_privacy in --strategy: give one"
        );
        let dp = dp_for_epsilon(&settings, args.selection, epsilon, delta, args.clip_norm)?;
        if strategy.is_null() {
            strategy = serde_json::json!({});
        }
        strategy["differential_privacy"] = dp;
    }
    // A seed repeats a run, except where the coordinator must draw (DP) or updates race
    // (asynchronous): there it fixes the data, the initial model and batch orders only.
    let dp = !strategy["differential_privacy"].is_null();
    let repeatable = !dp && args.asynchronous.is_none();
    let seeded = args.seed.is_some() || args.seeds.is_some();
    let seeded_cohorts = seeded && repeatable;
    if seeded && !repeatable {
        println!(
            "a {} run does not repeat bit for bit: the seed fixes the data, the initial model and batch orders; the coordinator draws the cohorts",
            if dp { "differentially private" } else { "asynchronous" }
        );
    }
    let base = SimulationConfig {
        url: args.url.clone(),
        operator_token: args.operator_token.clone(),
        tls: args.tls.settings()?,
        clients: settings.clients,
        cohort: settings.cohort,
        rounds: settings.rounds,
        dataset: settings.dataset,
        data_dir: args.data_dir.clone(),
        partition: settings.partition,
        model: settings.model,
        training: serde_json::json!({
            "epochs": settings.epochs,
            "batch_size": settings.batch_size,
            "lr": settings.lr,
            "fedprox_mu": settings.fedprox_mu,
            "optimizer": settings.local_optimizer,
        }),
        seed: seeds[0],
        max_examples: args.max_examples,
        backend: backend::select(args.backend)?,
        secure: args.secure,
        population: args.population.clone(),
        pacing: Pacing {
            over_selection: settings.over_selection,
            min_quorum: settings.min_quorum,
            selection_timeout_secs: args.selection_timeout_secs,
            reporting_timeout_secs: settings.reporting_timeout_secs,
        },
        holdout: settings.holdout,
        strategy,
        selection: args.selection,
        poisoning: args.attack.map(|attack| Poisoning { fraction: args.attackers, attack }),
        compression: args.compression,
        model_download: args.model_download,
        asynchronous: args.asynchronous,
        slowdown: args.slow,
        checkpoint_interval: args.checkpoint_interval,
        scoring: Scoring { every: args.eval_every, examples: args.eval_examples, initial: true },
        seeded_cohorts,
        timeout: args.timeout,
        target: args.target,
        lstm: settings.lstm,
        shakespeare: settings.shakespeare,
    };
    print_settings(&base, &settings, &args);
    let mut reached = vec![];
    for &seed in &seeds {
        let config = SimulationConfig { seed, ..base.clone() };
        let out = args.out.as_ref().map(|path| match &args.seeds {
            Some(_) => with_suffix(path, &format!("-seed{seed}")),
            None => path.clone(),
        });
        if args.seeds.is_some() {
            println!("seed {seed}");
        }
        let results = simulate_once(runtime, config, out.as_deref())?;
        if let Some(target) = args.target {
            let first = results.iter().find(|r| r.test_accuracy >= target).map(|r| r.version);
            match first {
                Some(v) => println!(
                    "seed {seed}: {:.2} % test accuracy first at round {v}",
                    target * 100.0
                ),
                None => println!(
                    "seed {seed}: {:.2} % not reached in {} rounds",
                    target * 100.0,
                    settings.rounds
                ),
            }
            reached.push((seed, first));
        }
    }
    if let (Some(_), Some(target)) = (&args.seeds, args.target) {
        let summary = RoundsToTarget::of(&reached);
        println!("{}", summary.describe(target, args.eval_every));
        if let Some(path) = &args.out {
            let path = with_suffix(&path.with_extension("csv"), "-summary");
            std::fs::write(&path, summary.csv(&reached))
                .with_context(|| format!("writing {}", path.display()))?;
        }
    }
    Ok(())
}

/// The settings a simulation runs with: a flag given, else the preset's, else the simulator's.
fn settings(args: &SimulateArgs) -> Settings {
    let base = match args.preset {
        Some(preset) => preset.settings(),
        None => Settings::simulator_defaults(args.clients),
    };
    Settings {
        clients: args.clients.unwrap_or(base.clients),
        cohort: args.cohort.unwrap_or(base.cohort),
        rounds: args.rounds.unwrap_or(base.rounds),
        dataset: args.dataset.unwrap_or(base.dataset),
        partition: args.partition.unwrap_or(base.partition),
        model: args.model.unwrap_or(base.model),
        epochs: args.epochs.unwrap_or(base.epochs),
        batch_size: args.batch_size.unwrap_or(base.batch_size),
        lr: args.lr.unwrap_or(base.lr),
        holdout: args.holdout.unwrap_or(base.holdout),
        over_selection: args.over_selection.unwrap_or(base.over_selection),
        min_quorum: args.min_quorum.or(base.min_quorum),
        reporting_timeout_secs: args.reporting_timeout_secs.unwrap_or(base.reporting_timeout_secs),
        fedprox_mu: args.fedprox_mu.unwrap_or(base.fedprox_mu),
        local_optimizer: args.local_optimizer.unwrap_or(base.local_optimizer),
        lstm: starling_client::simulate::LstmShape {
            layers: args.lstm_layers.unwrap_or(base.lstm.layers),
            hidden: args.lstm_hidden.unwrap_or(base.lstm.hidden),
            embedding: args.embedding_dim.unwrap_or(base.lstm.embedding),
        },
        shakespeare: starling_client::data::ShakespeareScale {
            windows_per_role: args.windows_per_role.unwrap_or(base.shakespeare.windows_per_role),
            test_roles: args.test_roles.unwrap_or(base.shakespeare.test_roles),
        },
    }
}

/// `strategy.differential_privacy` for ε at δ over the run: the smallest noise multiplier the
/// accountant of the selection that runs allows (fixed-size draws from the clients with
/// `random`, Poisson sampling with `poisson`).
fn dp_for_epsilon(
    settings: &Settings,
    selection: starling_core::plan::SelectionPolicy,
    epsilon: f64,
    delta: f64,
    clip_norm: f64,
) -> anyhow::Result<serde_json::Value> {
    use starling_core::plan::SelectionPolicy;
    use starling_core::privacy::{Sampling, noise_multiplier_for};
    let sampling = match selection {
        SelectionPolicy::Poisson => Sampling::Poisson,
        SelectionPolicy::Random => Sampling::FixedSize,
        SelectionPolicy::FirstCome => anyhow::bail!(
            "first_come selection cannot be accounted: use random or poisson with --epsilon"
        ),
    };
    anyhow::ensure!(epsilon > 0.0 && epsilon.is_finite(), "--epsilon must be positive");
    // The devices the coordinator draws per round, over-selection included (the plan's
    // `target_selected`): sizing z for the cohort alone once gave ε = 5.28 where 4 was asked.
    let selected = ((f64::from(settings.cohort) * settings.over_selection).ceil() as u32)
        .max(settings.cohort)
        .min(settings.clients as u32);
    let q = f64::from(selected) / settings.clients as f64;
    let z = noise_multiplier_for(sampling, q, u64::from(settings.rounds), delta, epsilon)
        .with_context(|| {
            format!(
                "no noise multiplier up to 1e4 keeps {} rounds within ε = {epsilon}",
                settings.rounds
            )
        })?;
    Ok(serde_json::json!({
        "noise_multiplier": z, "clip_norm": clip_norm, "population": settings.clients, "delta": delta,
    }))
}

/// Prints what the simulation will do, every setting it uses included.
fn print_settings(config: &SimulationConfig, settings: &Settings, args: &SimulateArgs) {
    let (model, partition) = match config.dataset {
        Dataset::Shakespeare => ("Lstm".to_owned(), "one client per speaking role".to_owned()),
        _ => (format!("{:?}", config.model), format!("{:?}", config.partition)),
    };
    let preset = args.preset.map_or(String::new(), |p| format!(" (preset {p:?})"));
    println!(
        "simulating {} clients ({:?}, {model}, {partition}){preset}, cohort {}, {} rounds against {}",
        config.clients, config.dataset, config.cohort, config.rounds, config.url
    );
    let quorum = settings.min_quorum.unwrap_or((settings.cohort * 4 / 5).max(1));
    let seed = match &args.seeds {
        Some(_) => "each seed".to_owned(),
        None => format!("seed {}", config.seed),
    };
    let cohorts = if config.seeded_cohorts {
        format!("cohorts drawn from {seed} (exactly {}, all must report)", config.cohort)
    } else {
        format!(
            "cohorts drawn by the coordinator ({:?}, over-selection ×{}, quorum {quorum})",
            config.selection, settings.over_selection
        )
    };
    println!(
        "E = {}, B = {}, η = {}, holdout {}, {cohorts}, max examples {}, scoring every {} model(s) on {}",
        settings.epochs,
        settings.batch_size,
        settings.lr,
        settings.holdout,
        if config.max_examples == 0 { "all".to_owned() } else { config.max_examples.to_string() },
        config.scoring.every,
        config
            .scoring
            .examples
            .map_or("the whole test set".to_owned(), |n| format!("{n} test examples")),
    );
    if let Some(dp) = config.strategy.get("differential_privacy").filter(|d| !d.is_null()) {
        println!("differential privacy: {dp}");
    }
    if let Some(warning) = starling_client::simulate::dp_noise_warning(config) {
        println!("warning: {warning}");
    }
    println!("training on {}", config.backend);
}

/// One simulation, its curve printed and written to `out` row by row as models are scored.
fn simulate_once(
    runtime: &tokio::runtime::Runtime,
    config: SimulationConfig,
    out: Option<&std::path::Path>,
) -> anyhow::Result<Vec<RoundResult>> {
    let mut writer = out.map(CurveWriter::create).transpose()?;
    let every = config.scoring.every;
    let dp = config.strategy.get("differential_privacy").is_some_and(|d| !d.is_null());
    println!(
        "{:>5}  {:>9}  {:>9}  {:>10}  {:>8}  {:>7}  {:>8}{}",
        "model",
        "test acc",
        "test loss",
        "train loss",
        "reported",
        "dropped",
        "round s",
        if dp { "        ε" } else { "" }
    );
    let bar = indicatif::ProgressBar::new(u64::from(config.rounds));
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} rounds {elapsed} {msg}")
            .expect("the template is valid"),
    );
    let mut write_error = None;
    let failed_bar = bar.clone();
    let on_failed = move |f: &starling_client::simulate::FailedRound| {
        if failed_bar.is_hidden() {
            println!("{f}");
            let _ = std::io::stdout().flush();
        } else {
            failed_bar.println(f.to_string());
        }
    };
    let results = runtime.block_on(simulate_reporting(
        config,
        |r| {
            let train = r.train_loss.map_or("-".to_owned(), |l| format!("{l:.4}"));
            let round = r.round_secs.map_or("-".to_owned(), |s| format!("{s:.1}"));
            let eps = r.epsilon.map_or(String::new(), |e| format!("  {e:>7.3}"));
            // A DP run with Poisson selection shows no cohort sizes.
            let count = |n: Option<i64>| n.map_or("-".to_owned(), |n| n.to_string());
            let row = format!(
                "{:>5}  {:>8.2}%  {:>9.4}  {:>10}  {:>8}  {:>7}  {:>8}{eps}",
                r.version,
                r.test_accuracy * 100.0,
                r.test_loss,
                train,
                count(r.reported),
                count(r.dropped),
                round
            );
            // A hidden bar (output is not a terminal) drops println: print the row directly then.
            if bar.is_hidden() {
                println!("{row}");
                let _ = std::io::stdout().flush();
            } else {
                bar.println(row);
            }
            bar.set_message(format!("test accuracy {:.2}%", r.test_accuracy * 100.0));
            bar.set_position(r.version.max(0) as u64);
            if let Some(w) = writer.as_mut()
                && let Err(e) = w.append(r)
            {
                write_error.get_or_insert(e);
            }
        },
        on_failed,
    ));
    bar.finish_and_clear();
    if let Some(e) = write_error {
        return Err(e);
    }
    let report = results?;
    println!("run {} trained population {:?}", report.run_id, report.population);
    if every > 1 {
        println!(
            "{} models scored: every {every}th and the last (--eval-every skipped the others)",
            report.rounds.len()
        );
    }
    if !report.not_evaluated.is_empty() {
        let versions: Vec<String> = report.not_evaluated.iter().map(i64::to_string).collect();
        println!(
            "models {} not evaluated: given up (checkpoint interval) before the evaluator got to them",
            versions.join(", ")
        );
    }
    Ok(report.rounds)
}

/// The curve file, written as each model is scored: a CSV row appended and flushed, or the
/// JSON array rewritten, so a stopped run leaves every row it scored.
struct CurveWriter {
    path: PathBuf,
    json: Option<Vec<RoundResult>>,
    csv: Option<std::io::BufWriter<std::fs::File>>,
}

impl CurveWriter {
    fn create(path: &std::path::Path) -> anyhow::Result<Self> {
        let context = || format!("writing {}", path.display());
        if path.extension().is_some_and(|e| e == "json") {
            std::fs::write(path, "[]\n").with_context(context)?;
            return Ok(CurveWriter { path: path.to_owned(), json: Some(vec![]), csv: None });
        }
        let mut file = std::io::BufWriter::new(std::fs::File::create(path).with_context(context)?);
        writeln!(file, "{}", RoundResult::CSV_HEADER).with_context(context)?;
        file.flush().with_context(context)?;
        Ok(CurveWriter { path: path.to_owned(), json: None, csv: Some(file) })
    }

    fn append(&mut self, r: &RoundResult) -> anyhow::Result<()> {
        let context = || format!("writing {}", self.path.display());
        if let Some(rows) = self.json.as_mut() {
            rows.push(r.clone());
            let text = serde_json::to_string_pretty(rows)?;
            // Whole or not at all: a reader never sees half an array.
            let partial = self.path.with_extension("json.partial");
            std::fs::write(&partial, text).with_context(context)?;
            std::fs::rename(&partial, &self.path).with_context(context)?;
        }
        if let Some(file) = self.csv.as_mut() {
            writeln!(file, "{}", r.csv_row()).with_context(context)?;
            file.flush().with_context(context)?;
        }
        Ok(())
    }
}

/// `path` with `suffix` before its extension.
fn with_suffix(path: &std::path::Path, suffix: &str) -> PathBuf {
    let stem = path.file_stem().map_or(String::new(), |s| s.to_string_lossy().into_owned());
    let name = match path.extension() {
        Some(ext) => format!("{stem}{suffix}.{}", ext.to_string_lossy()),
        None => format!("{stem}{suffix}"),
    };
    path.with_file_name(name)
}

/// Rounds to a target accuracy over several seeds.
#[derive(Debug, PartialEq)]
struct RoundsToTarget {
    /// Runs that reached it.
    reached: usize,
    /// Runs in all.
    runs: usize,
    /// Mean and sample standard deviation of the rounds, over the runs that reached it.
    mean: Option<f64>,
    sd: Option<f64>,
    /// Fewest and most.
    range: Option<(i64, i64)>,
}

impl RoundsToTarget {
    fn of(runs: &[(u64, Option<i64>)]) -> Self {
        let rounds: Vec<f64> = runs.iter().filter_map(|(_, r)| r.map(|r| r as f64)).collect();
        let n = rounds.len() as f64;
        let mean = (!rounds.is_empty()).then(|| rounds.iter().sum::<f64>() / n);
        let sd = mean
            .filter(|_| rounds.len() > 1)
            .map(|m| (rounds.iter().map(|r| (r - m).powi(2)).sum::<f64>() / (n - 1.0)).sqrt());
        let reached: Vec<i64> = runs.iter().filter_map(|(_, r)| *r).collect();
        let range = reached.iter().min().zip(reached.iter().max()).map(|(a, b)| (*a, *b));
        RoundsToTarget { reached: rounds.len(), runs: runs.len(), mean, sd, range }
    }

    fn describe(&self, target: f64, eval_every: u32) -> String {
        let mut text = format!(
            "rounds to {:.2} %: reached in {} of {} runs",
            target * 100.0,
            self.reached,
            self.runs
        );
        if let (Some(mean), Some((lo, hi))) = (self.mean, self.range) {
            text += &format!(", mean {mean:.1}");
            if let Some(sd) = self.sd {
                text += &format!(", sd {sd:.1}");
            }
            text += &format!(", range {lo}–{hi}");
        }
        if eval_every > 1 {
            text += &format!(" (scored every {eval_every} models: each is an upper bound)");
        }
        text
    }

    fn csv(&self, runs: &[(u64, Option<i64>)]) -> String {
        let mut csv = "seed,rounds_to_target\n".to_owned();
        for (seed, rounds) in runs {
            csv += &format!("{seed},{}\n", rounds.map_or(String::new(), |r| r.to_string()));
        }
        let opt = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v}"));
        csv += &format!("mean,{}\nsd,{}\n", opt(self.mean), opt(self.sd));
        csv
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn simulate_args(extra: &[&str]) -> SimulateArgs {
        let mut argv = vec!["starling-client", "simulate", "--operator-token", "t"];
        argv.extend_from_slice(extra);
        match Cli::try_parse_from(argv).unwrap().command {
            Command::Simulate(args) => *args,
            _ => panic!("not the simulate command"),
        }
    }

    #[test]
    fn a_preset_sets_the_papers_settings_and_flags_beside_it_win() {
        let s = settings(&simulate_args(&["--preset", "fedavg-mnist-2nn"]));
        assert_eq!(s, Preset::FedAvgMnist2nn.settings());
        assert_eq!((s.clients, s.cohort, s.epochs, s.batch_size, s.holdout), (100, 10, 1, 10, 0.0));
        assert_eq!((s.over_selection, s.min_quorum, s.dataset), (1.0, Some(10), Dataset::Mnist));
        let s = settings(&simulate_args(&[
            "--preset",
            "fedavg-mnist-cnn",
            "--partition",
            "shards:2",
            "--epochs",
            "1",
        ]));
        assert_eq!((s.model, s.epochs, s.partition), (ModelKind::Cnn, 1, Partition::Shards(2)));
        assert_eq!(s.reporting_timeout_secs, 120.0, "the default deadline covers a CNN round");
        // Without a preset: the simulator's defaults, the cohort half the clients.
        let s = settings(&simulate_args(&["--clients", "40"]));
        assert_eq!(
            (s.clients, s.cohort, s.epochs, s.holdout, s.dataset),
            (40, 20, 5, 0.1, Dataset::Digits)
        );
    }

    #[test]
    fn epsilon_and_delta_give_the_smallest_noise_the_runs_accountant_allows() {
        use starling_core::privacy::Sampling;
        let s = settings(&simulate_args(&["--preset", "fedavg-mnist-2nn", "--rounds", "30"]));
        let dp = dp_for_epsilon(&s, starling_core::plan::SelectionPolicy::Random, 4.0, 1e-5, 0.5)
            .unwrap();
        let z = dp["noise_multiplier"].as_f64().unwrap();
        let spent = |z: f64| Sampling::FixedSize.accountant(0.1, z).epsilon(30, 1e-5);
        assert!(spent(z) <= 4.0 && spent(z / 1.01) > 4.0, "z {z}: ε {}", spent(z));
        assert_eq!((dp["population"].as_u64(), dp["clip_norm"].as_f64()), (Some(100), Some(0.5)));
        let poisson =
            dp_for_epsilon(&s, starling_core::plan::SelectionPolicy::Poisson, 4.0, 1e-5, 0.5)
                .unwrap()["noise_multiplier"]
                .as_f64()
                .unwrap();
        assert!(poisson < z, "add/remove needs less noise than replace-one: {poisson} vs {z}");
        assert!(
            dp_for_epsilon(&s, starling_core::plan::SelectionPolicy::FirstCome, 4.0, 1e-5, 0.5)
                .is_err()
        );
        assert!(
            Cli::try_parse_from([
                "starling-client",
                "simulate",
                "--operator-token",
                "t",
                "--epsilon",
                "1"
            ])
            .is_err(),
            "--epsilon needs --delta"
        );
    }

    /// `simulate --epsilon` sized z for the cohort and the coordinator drew over-selection's
    /// more: ε = 4 requested, 5.28 spent. z is now sized for the devices actually drawn, and
    /// the plan the simulator submits spends at most ε, within 1 % of it.
    #[test]
    fn epsilon_is_sized_for_the_devices_drawn_with_over_selection() {
        let s = settings(&simulate_args(&["--clients", "100", "--cohort", "10", "--rounds", "30"]));
        assert_eq!(s.over_selection, 1.3);
        let dp = dp_for_epsilon(&s, starling_core::plan::SelectionPolicy::Random, 4.0, 1e-5, 0.5)
            .unwrap();
        let plan = serde_json::json!({
            "model": {
                "schema": {"tensors": [{"name": "w", "shape": [4], "dtype": "f32"}]},
                "init": {"kind": "seeded", "seed": 1},
            },
            "cohort_size": s.cohort, "over_selection": s.over_selection, "rounds": s.rounds,
            "strategy": {"differential_privacy": dp},
        });
        let plan: starling_core::plan::Plan = serde_json::from_value(plan).unwrap();
        let privacy = *plan.validate().unwrap().privacy().unwrap();
        let spent = privacy.epsilon_after(u64::from(s.rounds));
        assert!(spent <= 4.0 + 1e-9 && spent > 3.96, "ε {spent}");
    }

    /// The researcher's flags reach the plan's training section and the model: FedProx's μ, the
    /// local optimizer, the LSTM's shape and Shakespeare's scale; the paper's Shakespeare
    /// preset is the 2 × 256 LSTM on all of every role.
    #[test]
    fn the_researchers_flags_and_the_shakespeare_preset_set_what_they_say() {
        let s = settings(&simulate_args(&[
            "--fedprox-mu",
            "0.01",
            "--local-optimizer",
            "adam",
            "--lstm-layers",
            "2",
            "--lstm-hidden",
            "32",
            "--windows-per-role",
            "0",
            "--test-roles",
            "8",
        ]));
        assert_eq!(s.fedprox_mu, 0.01);
        assert_eq!(s.local_optimizer, starling_core::plan::LocalOptimizer::Adam);
        assert_eq!((s.lstm.layers, s.lstm.hidden, s.lstm.embedding), (2, 32, 8));
        assert_eq!((s.shakespeare.windows_per_role, s.shakespeare.test_roles), (0, 8));
        let defaults = settings(&simulate_args(&[]));
        assert_eq!((defaults.fedprox_mu, defaults.lstm.layers, defaults.lstm.hidden), (0.0, 1, 64));
        assert_eq!(defaults.shakespeare.windows_per_role, 400);
        let paper = settings(&simulate_args(&["--preset", "fedavg-shakespeare"]));
        assert_eq!(paper, Preset::FedAvgShakespeare.settings());
        assert_eq!((paper.dataset, paper.clients, paper.cohort), (Dataset::Shakespeare, 1423, 142));
        assert_eq!((paper.lstm.layers, paper.lstm.hidden, paper.lstm.embedding), (2, 256, 8));
        assert_eq!((paper.shakespeare.windows_per_role, paper.epochs, paper.lr), (0, 1, 1.47));
        let spec = starling_client::simulate::model_spec_with(
            ModelKind::Mlp,
            Dataset::Shakespeare.input(),
            paper.lstm,
        );
        let lstms = spec.layers.iter().filter(|l| format!("{l:?}").contains("Lstm")).count();
        assert_eq!(lstms, 2);
        assert!(
            Cli::try_parse_from([
                "starling-client",
                "simulate",
                "--operator-token",
                "t",
                "--local-optimizer",
                "lbfgs"
            ])
            .is_err()
        );
    }

    #[test]
    fn rounds_to_target_summarize_mean_spread_and_misses() {
        let runs = [(1, Some(50)), (2, Some(54)), (3, None), (4, Some(58))];
        let s = RoundsToTarget::of(&runs);
        assert_eq!(
            (s.reached, s.runs, s.mean, s.sd, s.range),
            (3, 4, Some(54.0), Some(4.0), Some((50, 58)))
        );
        assert_eq!(
            s.describe(0.97, 1),
            "rounds to 97.00 %: reached in 3 of 4 runs, mean 54.0, sd 4.0, range 50–58"
        );
        assert_eq!(s.csv(&runs), "seed,rounds_to_target\n1,50\n2,54\n3,\n4,58\nmean,54\nsd,4\n");
        assert_eq!(
            RoundsToTarget::of(&[(1, None)]).describe(0.5, 1),
            "rounds to 50.00 %: reached in 0 of 1 runs"
        );
        assert_eq!(
            with_suffix(std::path::Path::new("out/curve.csv"), "-seed3"),
            PathBuf::from("out/curve-seed3.csv")
        );
    }

    #[test]
    fn the_curve_is_on_disk_after_every_scored_model() {
        let dir = tempfile::tempdir().unwrap();
        let row = |version| RoundResult {
            version,
            test_accuracy: 0.5,
            test_loss: 1.0,
            train_loss: None,
            reported: Some(10),
            dropped: Some(0),
            elapsed_secs: 1.5,
            round_secs: Some(1.25),
            upload_bytes: Some(2048),
            epsilon: None,
            content_hash: "ab".into(),
        };
        let csv = dir.path().join("curve.csv");
        let mut w = CurveWriter::create(&csv).unwrap();
        w.append(&row(1)).unwrap();
        assert_eq!(
            std::fs::read_to_string(&csv).unwrap(),
            format!("{}\n1,0.5,1,,10,0,1.500,1.25,2048,,ab\n", RoundResult::CSV_HEADER)
        );
        let json = dir.path().join("curve.json");
        let mut w = CurveWriter::create(&json).unwrap();
        w.append(&row(1)).unwrap();
        w.append(&row(2)).unwrap();
        let rows: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert_eq!(rows.as_array().unwrap().len(), 2);
    }

    #[test]
    fn asynchronous_settings_parse_with_a_default_exponent_and_name_what_is_wrong() {
        let a = parse_asynchronous("20:4").unwrap();
        assert_eq!((a.concurrency, a.max_staleness, a.staleness_exponent), (20, 4, 0.5));
        assert_eq!(parse_asynchronous("13:2:1").unwrap().staleness_exponent, 1.0);
        for bad in ["20", "20:4:0.5:1", "x:4", "20:-1", "20:4:y"] {
            let err = parse_asynchronous(bad).unwrap_err();
            assert!(err.contains(bad) || err.contains("exponent"), "{bad}: {err}");
        }
    }
}

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
use starling_client::simulate::{Attack, ModelKind, Pacing, Poisoning, SimulationConfig, simulate};

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
    Simulate(SimulateArgs),
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
    #[arg(long, default_value_t = 24)]
    clients: usize,
    /// Reports per round [default: half the clients].
    #[arg(long)]
    cohort: Option<u32>,
    /// Rounds to commit.
    #[arg(long, default_value_t = 15)]
    rounds: u32,
    /// Dataset.
    #[arg(long, value_enum, default_value = "digits")]
    dataset: Dataset,
    /// The shared data folder.
    #[arg(long, env = "STARLING_DATA_DIR", default_value = "../shared/data")]
    data_dir: PathBuf,
    /// iid, dirichlet:ALPHA or shards:N.
    #[arg(long, default_value = "iid")]
    partition: Partition,
    /// Model.
    #[arg(long, value_enum, default_value = "mlp")]
    model: ModelKind,
    /// Local epochs (the FedAvg paper's E).
    #[arg(long, default_value_t = 5)]
    epochs: u32,
    /// Local batch size (the FedAvg paper's B).
    #[arg(long, default_value_t = 10)]
    batch_size: u32,
    /// Local learning rate.
    #[arg(long, default_value_t = 0.1)]
    lr: f64,
    /// Seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
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
    /// Devices selected per round, as a multiple of the cohort.
    #[arg(long, default_value_t = Pacing::default().over_selection)]
    over_selection: f64,
    /// Fewest reports a round commits with [default: 80 % of the cohort].
    #[arg(long)]
    min_quorum: Option<u32>,
    /// Longest time a round selects devices, in seconds.
    #[arg(long, default_value_t = Pacing::default().selection_timeout_secs)]
    selection_timeout_secs: f64,
    /// Longest time from a round's opening to its close, in seconds; it must cover local
    /// training (raise it for CNNs on CPUs).
    #[arg(long, default_value_t = Pacing::default().reporting_timeout_secs)]
    reporting_timeout_secs: f64,
    /// Fraction of each device's examples held out for federated evaluation (0: train on all).
    #[arg(long, default_value_t = 0.1)]
    holdout: f64,
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
    /// Write the curve here (`.json` for JSON, anything else CSV).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// The `starling-client` binary.
pub(crate) fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    match cli.command {
        Command::Simulate(args) => run_simulation(&runtime, args),
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
    .with_tls(&args.tls.settings()?)?;
    match ParticipantState::load(&args.state)?.filter(|s| s.credential.is_some()) {
        Some(state) => device = device.restore(state),
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
    let config = SimulationConfig {
        url: args.url,
        operator_token: args.operator_token,
        tls: args.tls.settings()?,
        clients: args.clients,
        cohort: args.cohort.unwrap_or((args.clients / 2).max(1) as u32),
        rounds: args.rounds,
        dataset: args.dataset,
        data_dir: args.data_dir,
        partition: args.partition,
        model: args.model,
        training: serde_json::json!({"epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr}),
        seed: args.seed,
        max_examples: args.max_examples,
        backend: backend::select(args.backend)?,
        secure: args.secure,
        population: args.population,
        pacing: Pacing {
            over_selection: args.over_selection,
            min_quorum: args.min_quorum,
            selection_timeout_secs: args.selection_timeout_secs,
            reporting_timeout_secs: args.reporting_timeout_secs,
        },
        holdout: args.holdout,
        strategy: match &args.strategy {
            None => serde_json::Value::Null,
            Some(text) => {
                let text = match text.strip_prefix('@') {
                    Some(path) => std::fs::read_to_string(path)
                        .with_context(|| format!("reading the strategy from {path}"))?,
                    None => text.clone(),
                };
                serde_json::from_str(&text).context("--strategy is not JSON")?
            }
        },
        selection: args.selection,
        poisoning: args.attack.map(|attack| Poisoning { fraction: args.attackers, attack }),
        compression: args.compression,
        model_download: args.model_download,
        asynchronous: args.asynchronous,
        slowdown: args.slow,
        checkpoint_interval: args.checkpoint_interval,
    };
    let (model, partition) = match config.dataset {
        Dataset::Shakespeare => ("Lstm".to_owned(), "one client per speaking role".to_owned()),
        _ => (format!("{:?}", config.model), format!("{:?}", config.partition)),
    };
    println!(
        "simulating {} clients ({:?}, {model}, {partition}), cohort {}, {} rounds against {}",
        config.clients, config.dataset, config.cohort, config.rounds, config.url
    );
    println!("training on {}", config.backend);
    println!(
        "{:>5}  {:>9}  {:>9}  {:>10}  {:>8}  {:>7}",
        "model", "test acc", "test loss", "train loss", "reported", "dropped"
    );
    let bar = indicatif::ProgressBar::new(u64::from(config.rounds));
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} rounds {elapsed} {msg}")
            .expect("the template is valid"),
    );
    let results = runtime.block_on(simulate(config, |r| {
        let train = r.train_loss.map_or("-".to_owned(), |l| format!("{l:.4}"));
        let row = format!(
            "{:>5}  {:>8.2}%  {:>9.4}  {:>10}  {:>8}  {:>7}",
            r.version,
            r.test_accuracy * 100.0,
            r.test_loss,
            train,
            r.reported,
            r.dropped
        );
        // A hidden bar (output is not a terminal) drops println: print the row directly then.
        if bar.is_hidden() {
            println!("{row}");
            let _ = std::io::stdout().flush();
        } else {
            bar.println(row);
        }
        bar.set_message(format!("test accuracy {:.2}%", r.test_accuracy * 100.0));
        bar.inc(1);
    }));
    bar.finish_and_clear();
    let report = results?;
    println!("run {} trained population {:?}", report.run_id, report.population);
    if !report.not_evaluated.is_empty() {
        let versions: Vec<String> = report.not_evaluated.iter().map(i64::to_string).collect();
        println!(
            "models {} not evaluated: given up (checkpoint interval) before the evaluator got to them",
            versions.join(", ")
        );
    }
    let results = report.rounds;
    if let Some(path) = args.out {
        let text = if path.extension().is_some_and(|e| e == "json") {
            serde_json::to_string_pretty(&results)?
        } else {
            let mut csv =
                "version,test_accuracy,test_loss,train_loss,reported,dropped\n".to_owned();
            for r in &results {
                let train = r.train_loss.map_or(String::new(), |l| l.to_string());
                csv += &format!(
                    "{},{},{},{},{},{}\n",
                    r.version, r.test_accuracy, r.test_loss, train, r.reported, r.dropped
                );
            }
            csv
        };
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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

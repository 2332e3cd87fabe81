//! `starling-client`: the SDK's command line for Linux devices and operators; today it runs the
//! simulator (`starling-client simulate`).

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use starling_client::backend::{self, BackendChoice};
use starling_client::simulate::{Dataset, ModelKind, Partition, SimulationConfig, simulate};

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
    /// Where to train: `auto` (wgpu on a GPU, else CPU), `wgpu` (any adapter, lavapipe included) or `cpu`.
    #[arg(long, env = "STARLING_BACKEND", default_value = "auto")]
    backend: BackendChoice,
    /// Write the curve here (`.json` for JSON, anything else CSV).
    #[arg(long)]
    out: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let Command::Simulate(args) = cli.command;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let config = SimulationConfig {
        url: args.url,
        operator_token: args.operator_token,
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
    let results = results?;
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

//! The `starling-aggregator` command line: one aggregator node of the datacenter tier.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::{Parser, ValueEnum};
use starling_aggregator::group::CollectiveChoice;
use starling_aggregator::{AggregatorConfig, Engine, GroupConfig, TransportSecurity};
use starling_core::AggregatorId;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum EngineChoice {
    /// CUDA when a GPU is present, else CPU.
    Auto,
    /// SIMD, multi-threaded CPU reduction.
    Cpu,
    /// CUDA on --gpu (fails with a clear error without a GPU).
    Cuda,
}

/// `--collective`: [`CollectiveChoice`] on the command line.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum CollectiveArg {
    Auto,
    Tcp,
    Http,
}

/// Starling aggregator node: devices of a large cohort upload here; partials go to the
/// coordinator.
#[derive(Debug, Parser)]
#[command(name = "starling-aggregator", version)]
struct Cli {
    /// This node's id (stable across restarts): a number, or a name ending in `-N` (a
    /// StatefulSet's pod name, `starling-aggregator-3`), whose N is taken.
    #[arg(long, env = "STARLING_AGGREGATOR_ID", value_parser = parse_node_id)]
    id: u32,
    /// Address to listen on.
    #[arg(long, env = "STARLING_AGGREGATOR_LISTEN", default_value = "127.0.0.1:9090")]
    listen: SocketAddr,
    /// URL devices reach this node at [default: http://{listen}].
    #[arg(long, env = "STARLING_AGGREGATOR_PUBLIC_URL")]
    public_url: Option<String>,
    /// The coordinator's base URL.
    #[arg(long, env = "STARLING_COORDINATOR_URL")]
    coordinator: String,
    /// Secret shared with the coordinator (its --aggregator-secret).
    #[arg(long, env = "STARLING_AGGREGATOR_SECRET", hide_env_values = true)]
    secret: String,
    /// Reduction engine.
    #[arg(long, value_enum, default_value = "auto")]
    engine: EngineChoice,
    /// GPU ordinal for the CUDA engine.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// Threads for the CPU engine [default: all].
    #[arg(long)]
    threads: Option<usize>,
    /// Aggregator group to join: its members hand their shards to the leader (rank 0), which
    /// reports one partial for the group; on CUDA with NCCL the members' sums meet in one
    /// NCCL all-reduce. Needs --rank and --world-size.
    #[arg(long, env = "STARLING_AGGREGATOR_GROUP", requires_all = ["rank", "world_size"])]
    group: Option<String>,
    /// This node's rank in its group (0 leads).
    #[arg(long, env = "STARLING_AGGREGATOR_RANK", requires = "group")]
    rank: Option<u32>,
    /// Members of the group, the leader included.
    #[arg(long, env = "STARLING_AGGREGATOR_WORLD_SIZE", requires = "group")]
    world_size: Option<u32>,
    /// How long past its deadline the leader waits for members' shards, milliseconds.
    #[arg(long, default_value_t = 2000)]
    group_wait_ms: u64,
    /// How the group's sums meet at the leader: `auto` (NCCL on CUDA nodes with NCCL
    /// present, else HTTP), `tcp` (the CPU collective, any engine) or `http`. Every member
    /// must choose the same.
    #[arg(long, value_enum, default_value = "auto", requires = "group")]
    collective: CollectiveArg,
    /// PEM certificate chain to serve TLS with (required unless --insecure-http).
    #[arg(long, env = "STARLING_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "STARLING_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// PEM CA certificates the coordinator's and the group leader's certificates chain to
    /// [default: the system's trust store].
    #[arg(long, env = "STARLING_CA_CERT", requires = "tls_cert")]
    ca_cert: Option<PathBuf>,
    /// Plain HTTP for devices, the coordinator and the group (the cluster secret and devices'
    /// updates then travel in clear): tests, or behind proxies that terminate TLS.
    #[arg(long, env = "STARLING_INSECURE_HTTP", conflicts_with = "tls_cert")]
    insecure_http: bool,
}

/// A node id from a number or from a name ending in `-N`: the manifests pass the pod name of a
/// StatefulSet, whose ordinal is stable across restarts (a bare number was all that parsed, so
/// the shipped manifest's `$(POD_NAME)` could not start a node).
fn parse_node_id(text: &str) -> Result<u32, String> {
    let ordinal = text.rsplit_once('-').map_or(text, |(_, n)| n);
    ordinal.parse().map_err(|_| {
        format!("{text:?} is neither a number nor a name ending in -N (a StatefulSet pod name)")
    })
}

/// Parses the command line and runs the node until Ctrl-C or SIGTERM.
pub(crate) fn main() -> anyhow::Result<()> {
    tokio::runtime::Runtime::new()?.block_on(run())
}

async fn run() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    if cli.secret.len() < 16 {
        bail!("the aggregator secret must be at least 16 characters");
    }
    let threads = cli.threads.unwrap_or_else(starling_aggregator::engine::available_threads);
    let engine = match cli.engine {
        EngineChoice::Auto => match Engine::detect() {
            Engine::Cpu { .. } => Engine::Cpu { threads },
            cuda => cuda,
        },
        EngineChoice::Cpu => Engine::Cpu { threads },
        EngineChoice::Cuda => {
            let info = starling_aggregator::gpu::probe().context("the CUDA engine needs a GPU")?;
            tracing::info!(gpu = %info.name, "CUDA engine");
            Engine::Cuda { device: cli.gpu }
        }
    };
    let group = match (cli.group, cli.rank, cli.world_size) {
        (Some(name), Some(rank), Some(world_size)) => {
            let group = GroupConfig {
                name,
                rank,
                world_size,
                wait: std::time::Duration::from_millis(cli.group_wait_ms),
                collective: match cli.collective {
                    CollectiveArg::Auto => CollectiveChoice::Auto,
                    CollectiveArg::Tcp => CollectiveChoice::Tcp,
                    CollectiveArg::Http => CollectiveChoice::Http,
                },
            };
            group.validate().context("--group/--rank/--world-size")?;
            Some(group)
        }
        _ => None,
    };
    let tls = match (cli.tls_cert, cli.tls_key) {
        (Some(cert), Some(key)) => TransportSecurity::Tls { cert, key, ca: cli.ca_cert },
        _ if cli.insecure_http => TransportSecurity::InsecureHttp,
        _ => bail!(
            "TLS is on by default: pass --tls-cert and --tls-key (STARLING_TLS_CERT, STARLING_TLS_KEY), \
             or --insecure-http to serve and call in plain HTTP"
        ),
    };
    let running = starling_aggregator::start(AggregatorConfig {
        id: AggregatorId(cli.id),
        listen: cli.listen,
        public_url: cli.public_url,
        coordinator_url: cli.coordinator,
        secret: cli.secret,
        engine,
        group,
        tls,
    })
    .await?;
    let addr = running.addr;
    // Tests and scripts read the bound address from this line.
    println!("starling-aggregator listening on {addr}");
    // Ctrl-C, or SIGTERM as `docker stop` and Kubernetes send it: a clean exit (a node holds
    // its shard in memory only, like a dropout).
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("listening for SIGTERM")?;
    tokio::select! {
        () = running.wait() => {}
        res = tokio::signal::ctrl_c() => { res?; }
        _ = terminate.recv() => tracing::info!("SIGTERM: stopping"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ids_are_numbers_or_stateful_set_pod_names() {
        assert_eq!(parse_node_id("7"), Ok(7));
        assert_eq!(parse_node_id("starling-aggregator-3"), Ok(3));
        assert!(parse_node_id("starling-aggregator").unwrap_err().contains("StatefulSet"));
        assert!(parse_node_id("node-x").is_err() && parse_node_id("").is_err());
    }
}

//! The fleet load generator: N protocol-level devices (enrolled in bulk; check-in, model
//! download, upload of pre-built deltas; no training) over M connections into a Postgres-backed
//! coordinator process, reporting rounds/s, check-ins/s, request latencies (p50 / p99 / max),
//! the coordinator's peak RSS, and the CPU of the coordinator, Postgres and the generator
//! itself, so a figure can say whether the generator was the bottleneck.
//!
//! `DATABASE_URL=postgres://... cargo bench -p starling-tests --bench fleet_throughput -- NxP`
//! (`cargo xtask postgres` prints a URL; any `NxP`, e.g. `10000x100000`; without one, a
//! default table). Options:
//!
//! * `--connections M`: connections the devices share (default 64); each carries one
//!   device's visit at a time, so the coordinator sees exactly M.
//! * `--arrival-rate R`: visits start at R per second with exponential gaps (default: as fast
//!   as the connections go).
//! * `--rounds K`: measured rounds (after one unmeasured warm-up round).
//! * `--compression ENC` (`int8`, `f16`, `top_k:0.01`, ...): the devices' upload encoding;
//!   `--model-download ENC`: the model's download encoding; `--checkpoint-interval K`: the
//!   plan's `checkpoint_interval`.
//! * `--replicas R`: R more coordinator processes on the same store serve the devices as
//!   replicas, relaying round decisions to the leader (which then serves no device itself).
//! * `--check-in-rate R [--seconds S]`: instead of rounds, random devices of the N check in at
//!   R per second for S seconds (default 30) while one round is open: the check-in latency of
//!   a large enrolled population.
//!
//! Every round's final model is checked against the exact FedAvg of the deltas sent (f32
//! uploads), and every round's durable update count against the acknowledgements: a figure
//! from a round that lost an update, or folded one wrongly, is never printed.
//! Each configuration gets a fresh database and coordinator process (its `VmHWM` is that
//! configuration's alone); the per-device rate limit and the per-address connection cap are
//! off, since every device here comes from one address.

mod fleet;
mod lean_http;
mod measure;

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, bail, ensure};
use sqlx::Connection;
use starling_client::protocol::{AdminClient, FleetClient};
use starling_core::compression::{Compression, ErrorFeedback};
use starling_core::rng::SplitMix64;
use starling_core::tensor::TensorPayload;
use starling_core::wire::UploadRequest;
use starling_core::{ModelVersion, RunId, codec};
use starling_tests::{ChildCoordinator, OPERATOR_TOKEN, PlanSpec, free_addr};

use fleet::{Connections, Visit, enroll_in_bulk};
use measure::{
    CpuTimes, Latencies, OpenDescriptors, RoundEvents, peak_rss_mib, percentiles, store_seconds,
};

/// Rounds run before the measured ones: the first round of a fresh process also opens every
/// connection and fills the store's pool, which a running fleet has done long before.
const WARM_UP_ROUNDS: i64 = 1;

/// What the coordinator and the aggregators share (`--aggregators`).
const AGGREGATOR_SECRET: &str = "fleet-throughput-bench-secret";

/// Distinct deltas the devices send (device `i` sends variant `i % VARIANTS`): enough that a
/// wrongly weighted or lost update moves the mean, few enough to build ahead.
const VARIANTS: usize = 8;

struct Options {
    connections: usize,
    arrival_rate: Option<f64>,
    rounds: Option<i64>,
    compression: Compression,
    model_download: Compression,
    checkpoint_interval: i64,
    check_in_rate: Option<f64>,
    seconds: f64,
    aggregators: u32,
    replicas: u32,
}

struct Config {
    devices: usize,
    params: usize,
    rounds: i64,
}

fn main() -> anyhow::Result<()> {
    let Ok(base_url) = std::env::var("DATABASE_URL") else {
        println!(
            "fleet_throughput skipped: DATABASE_URL is not set (cargo xtask postgres prints one)"
        );
        return Ok(());
    };
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let options = Options {
        connections: take(&mut args, "--connections")?.unwrap_or(64),
        arrival_rate: take(&mut args, "--arrival-rate")?,
        rounds: take(&mut args, "--rounds")?,
        compression: take(&mut args, "--compression")?.unwrap_or(Compression::F32),
        model_download: take(&mut args, "--model-download")?.unwrap_or(Compression::F32),
        checkpoint_interval: take(&mut args, "--checkpoint-interval")?.unwrap_or(1),
        check_in_rate: take(&mut args, "--check-in-rate")?,
        seconds: take(&mut args, "--seconds")?.unwrap_or(30.0),
        aggregators: take(&mut args, "--aggregators")?.unwrap_or(0),
        replicas: take(&mut args, "--replicas")?.unwrap_or(0),
    };
    options.model_download.check_model()?;
    ensure!(options.connections > 0, "--connections must be at least 1");
    let wanted: Vec<String> = args.into_iter().filter(|a| !a.starts_with('-')).collect();
    // The default table, or any `NxP` asked for (three measured rounds unless --rounds).
    let configs: Vec<Config> = if wanted.is_empty() {
        [(10, 1_000_000, 5), (100, 100_000, 5), (1000, 100_000, 3)]
            .into_iter()
            .map(|(devices, params, rounds)| Config {
                devices,
                params,
                rounds: options.rounds.unwrap_or(rounds),
            })
            .collect()
    } else {
        wanted
            .iter()
            .map(|w| {
                let (devices, params) =
                    w.split_once('x').with_context(|| format!("{w:?} is not NxP"))?;
                Ok(Config {
                    devices: devices.parse().with_context(|| format!("devices in {w:?}"))?,
                    params: params.parse().with_context(|| format!("parameters in {w:?}"))?,
                    rounds: options.rounds.unwrap_or(3),
                })
            })
            .collect::<anyhow::Result<_>>()?
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    println!(
        "uploads {}, model download {}, models written every {} versions, {} connections, {}, {}",
        options.compression,
        options.model_download,
        options.checkpoint_interval,
        options.connections,
        match options.arrival_rate.or(options.check_in_rate) {
            Some(rate) => format!("arrivals {rate}/s"),
            None => "arrivals as fast as they go".into(),
        },
        match (options.aggregators, options.replicas) {
            (0, 0) => "devices served by the coordinator".to_owned(),
            (0, r) => format!("devices served by {r} replicas"),
            (k, 0) => format!("uploads through {k} aggregators"),
            (k, r) => format!("devices served by {r} replicas, uploads through {k} aggregators"),
        },
    );
    for c in configs {
        runtime.block_on(bench(&base_url, &c, &options))?;
    }
    Ok(())
}

/// One configuration on a fresh database and coordinator process.
async fn bench(base_url: &str, c: &Config, options: &Options) -> anyhow::Result<()> {
    // Built from numbers only, so safe to splice into DDL (which takes no bind parameters).
    let db = format!("starling_bench_{}_{}", std::process::id(), c.devices);
    let mut admin_conn =
        sqlx::PgConnection::connect(base_url).await.context("connecting to DATABASE_URL")?;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {db}")))
        .execute(&mut admin_conn)
        .await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
        .execute(&mut admin_conn)
        .await?;
    let url = starling_coordinator::store::with_database(base_url, &db);
    let logs = tempfile::tempdir()?;
    // STARLING_BENCH_COORDINATOR runs another build of the coordinator (e.g. the release
    // binary, `cargo build --release -p starling-coordinator`) under the same generator.
    let bin = std::env::var_os("STARLING_BENCH_COORDINATOR").map_or_else(
        || Path::new(env!("CARGO_BIN_EXE_coordinator_under_test")).to_owned(),
        Into::into,
    );
    // STARLING_BENCH_LOG keeps the coordinator's log (e.g. with RUST_LOG=debug) for a look.
    let log = std::env::var_os("STARLING_BENCH_LOG")
        .map_or_else(|| logs.path().join("coordinator.log"), Into::into);
    let mut env = vec![
        ("STARLING_OPERATOR_TOKEN", OPERATOR_TOKEN),
        ("STARLING_DEVICE_RATE_LIMIT", "off"),
        ("STARLING_MAX_CONNECTIONS_PER_IP", "0"),
    ];
    if options.aggregators > 0 {
        // Every run's uploads go through the aggregators.
        env.extend([
            ("STARLING_AGGREGATOR_SECRET", AGGREGATOR_SECRET),
            ("STARLING_AGGREGATE_ABOVE", "0"),
        ]);
    }
    let child = ChildCoordinator::spawn_with(&bin, &url, free_addr(), &log, &env).await?;
    let aggregators = Aggregators::spawn(options.aggregators, &child.url).await?;
    let mut replicas = vec![];
    for k in 0..options.replicas {
        let log = logs.path().join(format!("replica-{k}.log"));
        replicas
            .push(ChildCoordinator::spawn_standby_with(&bin, &url, free_addr(), &log, &env).await?);
    }
    let servers = Servers { leader: &child, aggregators: &aggregators, replicas: &replicas };
    let enrolling = Instant::now();
    enroll_in_bulk(&url, c.devices).await?;
    println!("\n{} devices enrolled in {:.1} s", c.devices, enrolling.elapsed().as_secs_f64());
    let res = match options.check_in_rate {
        Some(rate) => check_ins(&servers, c, options, rate).await,
        None => rounds(&servers, c, options).await,
    };
    drop(replicas);
    drop(aggregators);
    drop(child);
    // The killed coordinator's connections may not have closed yet.
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)")))
        .execute(&mut admin_conn)
        .await?;
    res
}

/// `c.rounds` measured rounds (after the warm-up) of every enrolled device training.
async fn rounds(servers: &Servers<'_>, c: &Config, options: &Options) -> anyhow::Result<()> {
    let child = servers.leader;
    let admin = AdminClient::new(&child.url, OPERATOR_TOKEN);
    let mut events = RoundEvents::subscribe(&child.url).await?;
    let spec = PlanSpec {
        params: c.params as u64,
        cohort: c.devices as u32,
        over_selection: 1.0,
        quorum: c.devices as u32,
        selection_secs: 300.0,
        reporting_secs: 600.0,
        rounds: (c.rounds + WARM_UP_ROUNDS) as u32,
    };
    let mut plan = spec.json();
    plan["compression"] = serde_json::to_value(options.compression)?;
    plan["model_download"] = serde_json::to_value(options.model_download)?;
    if options.checkpoint_interval != 1 {
        plan["checkpoint_interval"] = options.checkpoint_interval.into();
    }
    let run = RunId(admin.create_run(&plan).await?.id);
    let connections =
        Connections::open(&servers.fleet_urls(), options.connections, options.model_download)?;
    let total_rounds = c.rounds + WARM_UP_ROUNDS;
    // Encoding is the devices' work, not the coordinator's: every round's bodies are built
    // before the clock starts.
    let bodies: Vec<Vec<bytes::Bytes>> = (0..total_rounds)
        .map(|round| round_bodies(&spec, options.compression, round))
        .collect::<anyhow::Result<_>>()?;
    // One device's upload body (every variant is as long).
    let body_bytes = bodies[0][0].len();
    let initial = model_values(&child.url, &admin, run, &spec, 0).await?;
    let descriptors = OpenDescriptors::watch(child.pid());
    let (mut latencies, mut acknowledged) = (Latencies::default(), 0);
    let (mut opening_secs, mut visits_secs, mut commit_secs) = (0.0, 0.0, 0.0);
    let mut commit_write_before = 0.0;
    let (mut measured_from, mut cpu_before) = (Instant::now(), servers.cpu()?);
    for (round, bodies) in (0..total_rounds).zip(bodies) {
        if round == WARM_UP_ROUNDS {
            (latencies, acknowledged) = (Latencies::default(), 0);
            (opening_secs, visits_secs, commit_secs) = (0.0, 0.0, 0.0);
            commit_write_before = store_seconds(&child.url, "commit_round").await?;
            (measured_from, cpu_before) = (Instant::now(), servers.cpu()?);
        }
        let opening = Instant::now();
        events.wait(run, round, "open").await?;
        opening_secs += opening.elapsed().as_secs_f64();
        let visit = Visit::Train {
            run,
            round,
            model_version: ModelVersion(round),
            model_bytes: options.model_download.max_encoded_len(c.params),
            bodies,
        };
        let played = connections.play(visit, c.devices, options.arrival_rate, round as u64).await?;
        visits_secs += played.elapsed.as_secs_f64();
        let commit = Instant::now();
        events.wait(run, round, "committed").await?;
        commit_secs += commit.elapsed().as_secs_f64();
        latencies.merge(played.latencies);
        acknowledged += played.acknowledged;
    }
    let round_secs = measured_from.elapsed().as_secs_f64();
    let cpu = servers.cpu()?.cores_since(&cpu_before);
    let commit_write_secs = store_seconds(&child.url, "commit_round").await? - commit_write_before;
    let verified = verify(&child.url, &admin, run, &spec, options, &initial).await?;
    let rounds = c.rounds as f64;
    println!(
        "{} devices x {} parameters, {} measured rounds, {:.1} MB uploaded a round",
        c.devices,
        c.params,
        c.rounds,
        (c.devices * body_bytes) as f64 / 1e6
    );
    println!(
        "  {:.2} s a round ({:.3} rounds/s), {:.0} updates/s end to end, {acknowledged} \
         uploads acknowledged, {verified}",
        round_secs / rounds,
        rounds / round_secs,
        acknowledged as f64 / round_secs,
    );
    println!(
        "  a round: opening {:.0} ms, the devices' visits {:.0} ms ({:.0} check-ins/s), \
         last acknowledgement to commit {:.0} ms (of it the commit's transaction {:.0} ms)",
        opening_secs / rounds * 1e3,
        visits_secs / rounds * 1e3,
        acknowledged as f64 / visits_secs,
        commit_secs / rounds * 1e3,
        commit_write_secs / rounds * 1e3,
    );
    print_latencies(&mut latencies);
    print_resources(&cpu, servers, &descriptors)
}

/// Check-ins of random enrolled devices at `rate` for `options.seconds` while a round is open.
async fn check_ins(
    servers: &Servers<'_>,
    c: &Config,
    options: &Options,
    rate: f64,
) -> anyhow::Result<()> {
    let child = servers.leader;
    let admin = AdminClient::new(&child.url, OPERATOR_TOKEN);
    let mut events = RoundEvents::subscribe(&child.url).await?;
    // A cohort of at most 100 of the population: the rest are told to come back later, as
    // most of a large population is at any moment.
    let cohort = c.devices.min(100) as u32;
    let mut spec = PlanSpec::all_of(cohort as usize, c.params, 1);
    (spec.selection_secs, spec.reporting_secs) = (3600.0, 7200.0);
    let run = RunId(admin.create_run(&spec.json()).await?.id);
    events.wait(run, 0, "open").await?;
    let connections =
        Connections::open(&servers.fleet_urls(), options.connections, options.model_download)?;
    let visits = (rate * options.seconds) as usize;
    let descriptors = OpenDescriptors::watch(child.pid());
    let cpu_before = servers.cpu()?;
    let mut played =
        connections.play(Visit::CheckIn { devices: c.devices }, visits, Some(rate), 7).await?;
    let cpu = servers.cpu()?.cores_since(&cpu_before);
    println!(
        "{} enrolled devices: {} check-ins in {:.1} s ({:.0}/s asked, {:.0}/s achieved), {} \
         given a task, the rest told to come back",
        c.devices,
        played.visits,
        played.elapsed.as_secs_f64(),
        rate,
        played.visits as f64 / played.elapsed.as_secs_f64(),
        played.tasks,
    );
    print_latencies(&mut played.latencies);
    print_resources(&cpu, servers, &descriptors)
}

/// CPU, the coordinator's (aggregators', replicas') peak memory, and the most descriptors the
/// leading coordinator held.
fn print_resources(
    cpu: &str,
    servers: &Servers<'_>,
    descriptors: &OpenDescriptors,
) -> anyhow::Result<()> {
    let peaks = |what: &str, pids: Vec<u32>| -> anyhow::Result<String> {
        let rss = pids
            .into_iter()
            .map(|pid| Ok(format!("{:.1}", peak_rss_mib(pid)?)))
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(if rss.is_empty() {
            String::new()
        } else {
            format!(" ({what}' {} MiB)", rss.join(", "))
        })
    };
    println!(
        "  {cpu}; coordinator peak RSS {:.1} MiB{}{}, at most {} descriptors open",
        peak_rss_mib(servers.leader.pid())?,
        peaks("aggregators", servers.aggregators.pids())?,
        peaks("replicas", servers.replica_pids())?,
        descriptors.most(),
    );
    Ok(())
}

/// The processes one configuration runs: the leading coordinator, its aggregators and its
/// replicas.
struct Servers<'a> {
    leader: &'a ChildCoordinator,
    aggregators: &'a Aggregators,
    replicas: &'a [ChildCoordinator],
}

impl Servers<'_> {
    /// Where the devices connect: the replicas when there are any, else the leader.
    fn fleet_urls(&self) -> Vec<String> {
        match self.replicas {
            [] => vec![self.leader.url.clone()],
            replicas => replicas.iter().map(|r| r.url.clone()).collect(),
        }
    }

    fn replica_pids(&self) -> Vec<u32> {
        self.replicas.iter().map(ChildCoordinator::pid).collect()
    }

    /// CPU times now, of every process measured.
    fn cpu(&self) -> anyhow::Result<CpuTimes> {
        CpuTimes::now(self.leader.pid(), &self.aggregators.pids(), &self.replica_pids())
    }
}

fn print_latencies(latencies: &mut Latencies) {
    println!(
        "  latency ms p50 / p99 / max: check-in {}, model download {}, upload {}",
        percentiles(&mut latencies.check_in),
        percentiles(&mut latencies.download),
        percentiles(&mut latencies.upload),
    );
}

/// Round `round`'s upload bodies, one per variant: `starling_tests::delta(variant, round)` with
/// `starling_tests::weight(variant)` examples, for the round's model version.
fn round_bodies(
    spec: &PlanSpec,
    compression: Compression,
    round: i64,
) -> anyhow::Result<Vec<bytes::Bytes>> {
    let schema = spec.schema();
    (0..VARIANTS)
        .map(|variant| {
            let data = encoded_delta(spec, compression, variant, round);
            let body = codec::to_vec(&UploadRequest {
                model_version: ModelVersion(round),
                example_count: starling_tests::weight(variant),
                metrics: [("loss".to_owned(), 0.5)].into(),
                delta: TensorPayload { schema_id: schema.schema_id(), data },
            })?;
            Ok(body.into())
        })
        .collect()
}

/// Variant `variant`'s delta in round `round`, as the devices send it: `compression`'s
/// encoding of `starling_tests::delta(variant, round)`.
fn encoded_delta(spec: &PlanSpec, compression: Compression, variant: usize, round: i64) -> Vec<u8> {
    let delta = starling_tests::delta(variant, round, spec.params as usize);
    compression.encode(&delta, &mut SplitMix64(round as u64), &mut ErrorFeedback::default())
}

/// The values of model `version` of `run`, as a device downloads them.
async fn model_values(
    url: &str,
    admin: &AdminClient,
    run: RunId,
    spec: &PlanSpec,
    version: i64,
) -> anyhow::Result<Vec<f32>> {
    let models = admin.models(run).await?;
    let model = models
        .iter()
        .find(|m| m.version == version)
        .with_context(|| format!("no model version {version}"))?;
    let device = FleetClient::with_credential(url, "bench-0");
    starling_tests::model_values(&device, &model.content_hash, &spec.schema()).await
}

/// Checks every round's durable update count against the cohort, and the final model against
/// the exact FedAvg of what was sent (the decoded values, for compressed uploads); says what
/// it checked.
async fn verify(
    url: &str,
    admin: &AdminClient,
    run: RunId,
    spec: &PlanSpec,
    options: &Options,
    initial: &[f32],
) -> anyhow::Result<String> {
    let rounds = admin.rounds(run).await?;
    for r in &rounds {
        if r.n_reported != Some(i64::from(spec.cohort)) {
            bail!("round {} holds {:?} updates, not {}", r.round_idx, r.n_reported, spec.cohort);
        }
    }
    let mut expected = initial.to_vec();
    for round in 0..i64::from(spec.rounds) {
        // Device i sends variant i % VARIANTS: each variant's weight times its senders.
        let senders = |v: usize| (spec.cohort as usize).saturating_sub(v).div_ceil(VARIANTS);
        let contributions: Vec<(Vec<f32>, u64)> = (0..VARIANTS)
            .filter(|&v| senders(v) > 0)
            .map(|v| {
                let encoded = encoded_delta(spec, options.compression, v, round);
                let sent = options.compression.validate(spec.params as usize, encoded)?.to_f32();
                Ok((sent, starling_tests::weight(v) * senders(v) as u64))
            })
            .collect::<anyhow::Result<_>>()?;
        expected = starling_tests::fedavg_expected(&expected, &contributions);
    }
    let got = model_values(url, admin, run, spec, i64::from(spec.rounds)).await?;
    let worst = got.iter().zip(&expected).map(|(g, e)| (g - e).abs()).fold(0.0f32, f32::max);
    ensure!(worst <= 1e-6, "the final model is off the exact FedAvg by up to {worst:e}");
    Ok(format!(
        "{} rounds' update counts and the final model (exact FedAvg, off by at most {worst:e}) \
         checked",
        rounds.len()
    ))
}

/// `--NAME VALUE` taken out of the arguments.
fn take<T: std::str::FromStr>(args: &mut Vec<String>, name: &str) -> anyhow::Result<Option<T>>
where
    T::Err: std::error::Error + Send + Sync + 'static,
{
    let Some(i) = args.iter().position(|a| a == name) else { return Ok(None) };
    let value = args.get(i + 1).with_context(|| format!("{name} needs a value"))?;
    let parsed = value.parse().with_context(|| format!("{name} {value}"))?;
    args.drain(i..i + 2);
    Ok(Some(parsed))
}

/// `--aggregators K`: K CPU aggregator processes the coordinator sends every upload through.
struct Aggregators(Vec<std::process::Child>);

impl Aggregators {
    async fn spawn(k: u32, coordinator: &str) -> anyhow::Result<Self> {
        use std::io::BufRead;
        // STARLING_BENCH_AGGREGATOR runs another build (e.g. the release binary).
        let bin = std::env::var_os("STARLING_BENCH_AGGREGATOR").map_or_else(
            || Path::new(env!("CARGO_BIN_EXE_aggregator_under_test")).to_owned(),
            Into::into,
        );
        let mut nodes = Aggregators(vec![]);
        for id in 1..=k {
            let mut child = std::process::Command::new(&bin)
                .args(["--id", &id.to_string(), "--listen", "127.0.0.1:0"])
                .args(["--coordinator", coordinator, "--engine", "cpu", "--insecure-http"])
                .env("STARLING_AGGREGATOR_SECRET", AGGREGATOR_SECRET)
                .env("RUST_LOG", "warn")
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::piped())
                .spawn()?;
            let mut line = String::new();
            let stdout = child.stdout.take().context("piped")?;
            nodes.0.push(child);
            std::io::BufReader::new(stdout).read_line(&mut line)?;
            ensure!(line.contains("listening on"), "aggregator {id} did not start: {line:?}");
        }
        if k > 0 {
            let http = starling_tests::http_client();
            starling_tests::wait_aggregators_live(coordinator, &http, k as usize).await?;
        }
        Ok(nodes)
    }

    fn pids(&self) -> Vec<u32> {
        self.0.iter().map(std::process::Child::id).collect()
    }
}

impl Drop for Aggregators {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

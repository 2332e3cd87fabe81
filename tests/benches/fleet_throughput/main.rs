//! Fleet throughput: N devices × P float32 parameters over real HTTP into a Postgres-backed
//! coordinator process; reports rounds/s, updates/s, upload MB/s and the coordinator's peak RSS.
//!
//! Run with `DATABASE_URL=postgres://... cargo bench -p starling-tests --bench fleet_throughput`
//! (`cargo xtask postgres` prints a URL). Optional arguments pick configurations, any `NxP`, e.g. `2000x100000`,
//! and `--compression int8` (or `f16`, `bf16`, `top_k:0.01`, ...) makes the run's devices upload
//! compressed deltas (the MB/round column is what they send), `--model-download int8` (or
//! `f16`, `bf16`) download the model compressed, `--rounds 20` measures more rounds than
//! the default (five for the large models), for comparisons finer than one pass's noise, and
//! `--checkpoint-interval 5` sets the plan's `checkpoint_interval` (models written every fifth
//! version instead of every one).
//! The per-device rate limit is off: ten devices making a round's three requests several
//! times a second are the load being measured.
//! Each configuration gets a fresh database and a fresh coordinator process, so the peak RSS
//! (`VmHWM`) is that configuration's alone. A first, unmeasured round warms it up (connections
//! opened, pools filled), so the figures are a running fleet's rounds.

use starling_core::codec;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures_util::StreamExt;
use futures_util::stream;
use sqlx::Connection;
use starling_client::protocol::{AdminClient, FleetClient};
use starling_core::RunId;
use starling_core::compression::{Compression, ErrorFeedback};
use starling_core::rng::SplitMix64;
use starling_core::tensor::TensorPayload;
use starling_core::wire::{CBOR_MEDIA_TYPE, UploadRequest};
use starling_tests::{ChildCoordinator, OPERATOR_TOKEN, PlanSpec, enroll, expect_task, free_addr};

/// Uploads in flight at once (a fleet's devices do not all connect in the same millisecond).
const CONCURRENCY: usize = 64;

/// Rounds run before the measured ones: the first round of a fresh process also opens every
/// connection (devices' HTTP, the store's pool), which a running fleet has done long before.
const WARM_UP_ROUNDS: i64 = 1;

/// How long a round may take to open or commit before the bench gives up.
const TIMEOUT: Duration = Duration::from_secs(60);

struct Config {
    devices: usize,
    params: usize,
    rounds: i64,
}

struct Measured {
    /// Bytes of one device's upload body.
    body_bytes: usize,
    /// Wall-clock seconds of the measured rounds, end to end: from the warm-up round's model
    /// to the last one's.
    round_secs: f64,
    /// Seconds over all rounds from the previous model to the round being open.
    opening_secs: f64,
    upload_secs: f64,
    /// Seconds over all rounds from opening to every task handed out.
    check_in_secs: f64,
    /// Seconds over all rounds of every device downloading the model.
    download_secs: f64,
    /// Seconds over all rounds from the last upload's acknowledgement to the new model (the
    /// coordinator's live event saying so).
    commit_secs: f64,
    /// The coordinator's own clock over all rounds: closing to the start of the commit's
    /// transaction (the new model's `created_at`): folding what is left, encoding, hashing.
    server_commit_secs: f64,
    /// Seconds over all rounds of the commit's transaction (new model row, round row, payloads
    /// released), from the coordinator's `store_seconds` histogram.
    commit_write_secs: f64,
    peak_rss_mib: f64,
}

fn main() -> anyhow::Result<()> {
    let Ok(base_url) = std::env::var("DATABASE_URL") else {
        println!(
            "fleet_throughput skipped: DATABASE_URL is not set (cargo xtask postgres prints one)"
        );
        return Ok(());
    };
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let compression = take_encoding(&mut args, "--compression")?;
    let model_download = take_encoding(&mut args, "--model-download")?;
    model_download.check_model()?;
    // More measured rounds than the default, for comparisons finer than a pass's noise.
    let rounds = take_number(&mut args, "--rounds")?;
    let checkpoint_interval = take_number(&mut args, "--checkpoint-interval")?.unwrap_or(1);
    let wanted: Vec<String> = args.into_iter().filter(|a| !a.starts_with('-')).collect();
    // The default table, or any `NxP` asked for (three measured rounds unless --rounds).
    let configs: Vec<Config> = if wanted.is_empty() {
        [(10, 1_000_000, 5), (100, 100_000, 5), (1000, 100_000, 3)]
            .into_iter()
            .map(|(devices, params, default)| Config {
                devices,
                params,
                rounds: rounds.unwrap_or(default),
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
                    rounds: rounds.unwrap_or(3),
                })
            })
            .collect::<anyhow::Result<_>>()?
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    println!(
        "compression: {compression}, model download: {model_download}, models written every {checkpoint_interval} versions"
    );
    println!(
        "{:>6} {:>9} {:>6} {:>9} {:>9} {:>10} {:>12} {:>10} {:>13}",
        "N",
        "P",
        "rounds",
        "MB/round",
        "rounds/s",
        "updates/s",
        "upload MB/s",
        "e2e upd/s",
        "peak RSS MiB"
    );
    for c in configs {
        let m = runtime.block_on(bench(
            &base_url,
            &c,
            (compression, model_download),
            checkpoint_interval,
        ))?;
        let bytes_per_round = (c.devices * m.body_bytes) as f64;
        let rounds = c.rounds as f64;
        println!(
            "{:>6} {:>9} {:>6} {:>9.1} {:>9.2} {:>10.1} {:>12.1} {:>10.1} {:>13.1}",
            c.devices,
            c.params,
            c.rounds,
            bytes_per_round / 1e6,
            rounds / m.round_secs,
            rounds * c.devices as f64 / m.upload_secs,
            rounds * bytes_per_round / m.upload_secs / 1e6,
            rounds * c.devices as f64 / m.round_secs,
            m.peak_rss_mib,
        );
        let ms = |secs: f64| secs / rounds * 1e3;
        println!(
            "{:>6} ms per round: opening {:.0}, check-in {:.0}, model download {:.0}, upload {:.0}, \
             commit {:.0} (coordinator: closing to the commit's start {:.0}, the commit's \
             transaction {:.0})",
            "",
            ms(m.opening_secs),
            ms(m.check_in_secs),
            ms(m.download_secs),
            ms(m.upload_secs),
            ms(m.commit_secs),
            ms(m.server_commit_secs),
            ms(m.commit_write_secs),
        );
    }
    Ok(())
}

async fn bench(
    base_url: &str,
    c: &Config,
    (compression, model_download): (Compression, Compression),
    checkpoint_interval: i64,
) -> anyhow::Result<Measured> {
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
    let bin = Path::new(env!("CARGO_BIN_EXE_coordinator_under_test"));
    // STARLING_BENCH_LOG keeps the coordinator's log (e.g. with RUST_LOG=debug) for a look.
    let log = std::env::var_os("STARLING_BENCH_LOG")
        .map_or_else(|| logs.path().join("coordinator.log"), Into::into);
    let env = [("STARLING_OPERATOR_TOKEN", OPERATOR_TOKEN), ("STARLING_DEVICE_RATE_LIMIT", "off")];
    let child = ChildCoordinator::spawn_with(bin, &url, free_addr(), &log, &env).await?;
    let res = drive(&child, c, (compression, model_download), checkpoint_interval).await;
    drop(child);
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {db}")))
        .execute(&mut admin_conn)
        .await?;
    res
}

async fn drive(
    child: &ChildCoordinator,
    c: &Config,
    (compression, model_download): (Compression, Compression),
    checkpoint_interval: i64,
) -> anyhow::Result<Measured> {
    let admin = AdminClient::new(&child.url, OPERATOR_TOKEN);
    let devices = enroll(&child.url, &admin, c.devices).await?;
    // Told of each round's opening and commit as it happens, as a fleet whose devices come
    // back at once would be: a poll would add its interval to every phase it waits for.
    let mut rounds = RoundEvents::subscribe(&child.url).await?;
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
    plan["compression"] = serde_json::to_value(compression)?;
    plan["model_download"] = serde_json::to_value(model_download)?;
    if checkpoint_interval != 1 {
        plan["checkpoint_interval"] = checkpoint_interval.into();
    }
    let run = RunId(admin.create_run(&plan).await?.id);
    let delta: Vec<f32> = (0..c.params).map(|j| ((j % 201) as f32 - 100.0) * 1e-4).collect();
    let (mut upload_secs, mut body_bytes) = (0.0, 0);
    let (mut opening_secs, mut check_in_secs, mut download_secs, mut commit_secs) =
        (0.0, 0.0, 0.0, 0.0);
    // Encoding is the devices' work, not the coordinator's: every round's is done before the
    // clock starts.
    let mut feedback = ErrorFeedback::default();
    let mut deltas: Vec<Vec<u8>> = (0..c.rounds + WARM_UP_ROUNDS)
        .map(|round| compression.encode(&delta, &mut SplitMix64(round as u64), &mut feedback))
        .collect();
    let (mut commit_write_before, mut measured_from) = (0.0, Instant::now());
    for round in 0..c.rounds + WARM_UP_ROUNDS {
        let data = std::mem::take(&mut deltas[round as usize]);
        if round == WARM_UP_ROUNDS {
            (upload_secs, opening_secs, check_in_secs, download_secs, commit_secs) =
                (0.0, 0.0, 0.0, 0.0, 0.0);
            commit_write_before = store_seconds(&child.url, "commit_round").await?;
            measured_from = Instant::now();
        }
        let opening_started = Instant::now();
        rounds.wait(run, round, "open").await?;
        opening_secs += opening_started.elapsed().as_secs_f64();
        let started = Instant::now();
        let tasks: Vec<_> =
            stream::iter(&devices).map(expect_task).buffer_unordered(CONCURRENCY).collect().await;
        let tasks = tasks.into_iter().collect::<Result<Vec<_>, _>>()?;
        check_in_secs += started.elapsed().as_secs_f64();
        let download_started = Instant::now();
        // Every device downloads the model, as real devices would (all share one hash).
        let models: Vec<_> = stream::iter(&devices)
            .map(|d| d.model_in(&tasks[0].model_hash, model_download))
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
        for m in models {
            m?;
        }
        download_secs += download_started.elapsed().as_secs_f64();
        let body = codec::to_vec(&UploadRequest {
            model_version: tasks[0].model_version,
            example_count: 32,
            metrics: [("loss".to_owned(), 0.5)].into(),
            delta: TensorPayload { schema_id: tasks[0].schema.schema_id(), data },
        })?;
        body_bytes = body.len();
        let path = format!("/v1/runs/{run}/rounds/{round}/updates");
        let upload_started = Instant::now();
        let results: Vec<_> = stream::iter(&devices)
            .map(|d: &FleetClient| d.post_raw(&path, body.clone(), CBOR_MEDIA_TYPE))
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
        for r in results {
            let (status, bytes) = r?;
            if !status.is_success() {
                bail!("upload failed: {status} {}", String::from_utf8_lossy(&bytes));
            }
        }
        upload_secs += upload_started.elapsed().as_secs_f64();
        let commit_started = Instant::now();
        rounds.wait(run, round, "committed").await?;
        commit_secs += commit_started.elapsed().as_secs_f64();
    }
    let round_secs = measured_from.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let models = admin.models(run).await?;
    let server_commit_ms: i64 = admin
        .rounds(run)
        .await?
        .iter()
        .filter(|r| r.round_idx >= WARM_UP_ROUNDS)
        .filter_map(|r| {
            let model = models.iter().find(|m| m.version == r.model_version + 1)?;
            Some(model.created_at_ms - r.closed_at_ms?)
        })
        .sum();
    Ok(Measured {
        body_bytes,
        round_secs,
        opening_secs,
        upload_secs,
        check_in_secs,
        download_secs,
        commit_secs,
        server_commit_secs: server_commit_ms as f64 / 1e3,
        commit_write_secs: store_seconds(&child.url, "commit_round").await? - commit_write_before,
        peak_rss_mib: peak_rss_mib(child.pid())?,
    })
}

/// The coordinator's live events (`/v1/admin/events`, server-sent), read for round changes.
struct RoundEvents {
    stream: reqwest::Response,
    /// Text received and not yet parsed into whole events.
    pending: String,
}

impl RoundEvents {
    async fn subscribe(url: &str) -> anyhow::Result<Self> {
        let stream = starling_tests::http_client()
            .get(format!("{url}/v1/admin/events"))
            .bearer_auth(OPERATOR_TOKEN)
            .send()
            .await?
            .error_for_status()?;
        Ok(RoundEvents { stream, pending: String::new() })
    }

    /// Reads events until round `round_idx` of `run` reaches `state` (`open`, `committed`).
    async fn wait(&mut self, run: RunId, round_idx: i64, state: &str) -> anyhow::Result<()> {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            while let Some(end) = self.pending.find("\n\n") {
                let event: String = self.pending.drain(..end + 2).collect();
                if event.lines().any(|l| l == "event: reload") {
                    bail!("fell behind the coordinator's live events");
                }
                let Some(data) = event.lines().find_map(|l| l.strip_prefix("data: ")) else {
                    continue;
                };
                let update: serde_json::Value = serde_json::from_str(data)?;
                if update["type"] == "round"
                    && update["run_id"] == run.0
                    && update["round_idx"] == round_idx
                {
                    match update["state"].as_str() {
                        Some(s) if s == state => return Ok(()),
                        Some("failed") => bail!("round {round_idx} failed"),
                        _ => {}
                    }
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let chunk = tokio::time::timeout(left, self.stream.chunk())
                .await
                .with_context(|| format!("timed out waiting for round {round_idx} {state}"))??
                .context("the live event stream ended")?;
            self.pending.push_str(std::str::from_utf8(&chunk)?);
        }
    }
}

/// `--NAME N` taken out of the arguments.
fn take_number(args: &mut Vec<String>, name: &str) -> anyhow::Result<Option<i64>> {
    let Some(i) = args.iter().position(|a| a == name) else { return Ok(None) };
    let value = args.get(i + 1).with_context(|| format!("{name} needs a value"))?.parse()?;
    args.drain(i..i + 2);
    Ok(Some(value))
}

/// `--NAME ENCODING` taken out of the arguments (f32 when absent).
fn take_encoding(args: &mut Vec<String>, name: &str) -> anyhow::Result<Compression> {
    let Some(i) = args.iter().position(|a| a == name) else { return Ok(Compression::F32) };
    let value = args.get(i + 1).with_context(|| format!("{name} needs a value"))?.parse()?;
    args.drain(i..i + 2);
    Ok(value)
}

/// The sum of the coordinator's `store_seconds` histogram for one operation.
async fn store_seconds(url: &str, op: &str) -> anyhow::Result<f64> {
    let metrics = starling_tests::http_client()
        .get(format!("{url}/metrics"))
        .bearer_auth(OPERATOR_TOKEN)
        .send()
        .await?
        .text()
        .await?;
    let label = format!("op=\"{op}\"");
    metrics
        .lines()
        .find(|l| l.contains("store_seconds_sum") && l.contains(&label))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .with_context(|| format!("no store_seconds_sum for {op} in /metrics"))
}

fn peak_rss_mib(pid: u32) -> anyhow::Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmHWM in /proc/pid/status")?;
    Ok(kib / 1024.0)
}

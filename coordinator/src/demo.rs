//! `starling-coordinator demo`: one command that shows rounds completing.
//!
//! It starts a coordinator on a fresh embedded SQLite store, creates a run, and drives it with
//! built-in load clients: real devices over real HTTP (enroll, check in, download, upload,
//! evaluate) whose "training" is a closed-form step towards a private per-device target.
//! The global model converges to the example-weighted mean of the targets, so the evaluation
//! loss printed each round falls. Some devices drop out on purpose.
//! The client SDK replaces these load clients with burn training on real data.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use starling_core::tensor::TensorSchema;
use starling_core::wire::{CheckInResponse, EvaluationReport, TaskAssignment, UploadRequest};
use starling_core::{ModelVersion, RunId};

use crate::client::{AdminClient, FleetClient};
use crate::http::random_secret;
use crate::{ServeConfig, start};

/// Options of `starling-coordinator demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Simulated devices.
    #[arg(long, default_value_t = 24)]
    pub clients: usize,
    /// Rounds to commit.
    #[arg(long, default_value_t = 8)]
    pub rounds: u32,
    /// Model parameters.
    #[arg(long, default_value_t = 10_000)]
    pub params: u64,
    /// Probability that a selected device drops out instead of uploading.
    #[arg(long, default_value_t = 0.1)]
    pub dropout: f64,
    /// Directory for the embedded store (recreated).
    #[arg(long, default_value = "starling-data/demo")]
    pub dir: PathBuf,
    /// Address to serve on, so the admin API can be browsed while the demo runs.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
}

/// Runs the demo to completion.
pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(args.dir.join(format!("demo.db{suffix}")));
    }
    let database_url = format!("sqlite://{}", args.dir.join("demo.db").display());
    let operator_token = random_secret("stop");
    let running = start(ServeConfig {
        listen: args.listen,
        database_url,
        operator_token: operator_token.clone(),
        migrate: true,
    })
    .await
    .context("starting the coordinator")?;
    let url = running.url();
    println!("coordinator: {url} (embedded store in {})", args.dir.display());
    println!("admin API:   curl -H 'Authorization: Bearer {operator_token}' {url}/v1/admin/runs");

    let admin = AdminClient::new(&url, &operator_token);
    let enrollment = admin.enrollment_token(None).await?;
    let cohort = (args.clients * 2 / 3).max(1) as u32;
    let plan = serde_json::json!({
        "name": "demo",
        "model": {
            "schema": {"tensors": [{"name": "w", "shape": [args.params], "dtype": "f32"}]},
            "init": {"kind": "zeros"}
        },
        "training": {"kind": "demo-target", "step": 0.5},
        "cohort_size": cohort,
        "over_selection": 1.3,
        "min_quorum": (cohort * 3 / 4).max(1),
        "selection_timeout_secs": 3.0,
        "reporting_timeout_secs": 15.0,
        "rounds": args.rounds,
    });
    let run = admin.create_run(&plan).await?;
    let run_id = RunId(run.id);
    println!(
        "run {run_id}: {} devices, cohort {cohort} (+30% over-selection), {} rounds, {} parameters\n",
        args.clients, args.rounds, args.params
    );

    let stop = Arc::new(AtomicBool::new(false));
    let mut devices = vec![];
    for idx in 0..args.clients {
        let device = LoadClient {
            url: url.clone(),
            idx: idx as u64,
            dropout: args.dropout,
            stop: stop.clone(),
        };
        let enrollment = enrollment.clone();
        devices.push(tokio::spawn(async move { device.run(&enrollment).await }));
    }

    println!(
        "{:>5}  {:<9}  {:>8}  {:>8}  {:>7}  {:>10}  {:>10}",
        "round", "state", "selected", "reported", "dropped", "train loss", "eval loss"
    );
    let mut printed = 0;
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let rounds = admin.rounds(run_id).await?;
        let models = admin.models(run_id).await?;
        for r in rounds.iter().skip(printed).take_while(|r| r.state != "open") {
            let train = r
                .metrics
                .as_ref()
                .and_then(|m| m.get("loss"))
                .map_or("-".into(), |l| format!("{l:.5}"));
            let eval = models
                .iter()
                .find(|m| m.version == r.model_version)
                .and_then(|m| m.evaluation.get("loss"))
                .map_or("-".into(), |l| format!("{l:.5}"));
            println!(
                "{:>5}  {:<9}  {:>8}  {:>8}  {:>7}  {:>10}  {:>10}",
                r.round_idx,
                r.state,
                r.n_selected,
                r.n_reported,
                r.n_dropped.unwrap_or(0),
                train,
                eval
            );
            printed += 1;
        }
        let run = admin.run(run_id).await?;
        if run.status != "running" && printed == rounds.len() {
            println!(
                "\nrun {run_id} {}: model version {} ({})",
                run.status,
                run.model_version,
                run.model_hash.unwrap_or_default()
            );
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    for d in devices {
        // A device may be asleep (pace steering, a simulated dropout): end it rather than wait.
        if d.is_finished() {
            d.await.context("device task")??;
        } else {
            d.abort();
        }
    }
    running.shutdown().await?;
    Ok(())
}

/// The private target of device `idx`: a shared pattern plus a device-specific offset.
pub fn device_target(idx: u64, n: usize) -> Vec<f32> {
    let offset = ((idx % 7) as f32 - 3.0) * 0.1;
    (0..n).map(|j| ((j % 17) as f32 / 17.0 - 0.5) + offset).collect()
}

struct LoadClient {
    url: String,
    idx: u64,
    dropout: f64,
    stop: Arc<AtomicBool>,
}

impl LoadClient {
    async fn run(self, enrollment: &str) -> anyhow::Result<()> {
        let mut fleet = FleetClient::new(&self.url);
        fleet.enroll(enrollment).await.context("enrolling")?;
        let mut rng = self.idx.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut unit = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng >> 11) as f64 / (1u64 << 53) as f64
        };
        let mut evaluated: Option<ModelVersion> = None;
        while !self.stop.load(Ordering::Relaxed) {
            match fleet.check_in("default").await {
                Ok(CheckInResponse::ComeBackLater { retry_after_secs }) => {
                    tokio::time::sleep(
                        Duration::from_secs(u64::from(retry_after_secs))
                            .min(Duration::from_secs(2)),
                    )
                    .await;
                }
                Ok(CheckInResponse::Task(task)) => {
                    let drop_out = unit() < self.dropout;
                    let work = Duration::from_millis(50 + (unit() * 250.0) as u64);
                    if let Err(e) =
                        self.participate(&fleet, &task, drop_out, work, &mut evaluated).await
                    {
                        tracing::debug!(device = self.idx, error = %e, "participation failed");
                    }
                }
                Err(e) => {
                    tracing::debug!(device = self.idx, error = %e, "check-in failed");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
        Ok(())
    }

    async fn participate(
        &self,
        fleet: &FleetClient,
        task: &TaskAssignment,
        drop_out: bool,
        work: Duration,
        evaluated: &mut Option<ModelVersion>,
    ) -> anyhow::Result<()> {
        let payload = fleet.model(&task.model_hash).await?;
        let global = task.schema.decode_f32(&payload)?;
        let target = device_target(self.idx, global.len());
        let loss = mse(&global, &target);
        if *evaluated != Some(task.model_version) {
            let report = EvaluationReport {
                model_version: task.model_version,
                example_count: 100,
                metrics: BTreeMap::from([("loss".to_owned(), loss)]),
            };
            fleet.evaluate(task.run_id, &report).await?;
            *evaluated = Some(task.model_version);
        }
        tokio::time::sleep(work).await;
        if drop_out {
            // Vanish for the rest of the round, like a phone that lost its network.
            let wait = (task.report_deadline_ms - crate::clock::now_ms()).max(0) as u64;
            tokio::time::sleep(Duration::from_millis(wait)).await;
            return Ok(());
        }
        let delta: Vec<f32> = global.iter().zip(&target).map(|(w, t)| 0.5 * (t - w)).collect();
        let update = UploadRequest {
            model_version: task.model_version,
            example_count: 50 + self.idx % 5 * 10,
            metrics: BTreeMap::from([("loss".to_owned(), loss)]),
            delta: schema_payload(&task.schema, &delta),
        };
        fleet.upload(task.run_id, task.round_idx, &update).await?;
        Ok(())
    }
}

fn schema_payload(schema: &TensorSchema, values: &[f32]) -> starling_core::tensor::TensorPayload {
    schema.encode_f32(values)
}

fn mse(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum::<f64>() / a.len().max(1) as f64
}

//! A whole SecAgg+ round over real HTTP: N devices (the SDK's `SecureSession`, one task each)
//! and an in-process coordinator on a fresh SQLite store, M float32 parameters, no dropouts.
//! Reports the round's wall time from the first AdvertiseKeys to the committed model, and each
//! stage's share of it (bytes per client are exact in the core benchmark).
//!
//! Run with `cargo bench --workspace --bench secure_round` (optional arguments pick
//! configurations, e.g. `10x100000`). Compute-only figures (per-client and server time at
//! n = 50..1000) are in `cargo bench -p starling-core --bench secagg`.

use std::time::Instant;

use futures_util::future::join_all;
use starling_client::secure::SecureSession;
use starling_core::{ModelVersion, RunId};
use starling_tests::{
    PlanSpec, delta, enroll, expect_tasks, sqlite_db, start_in_process_with, wait_model,
    wait_round_open, weight,
};

fn main() -> anyhow::Result<()> {
    let wanted: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let configs: Vec<(usize, usize)> = [(10, 100_000), (50, 100_000), (100, 100_000)]
        .into_iter()
        .filter(|(n, m)| wanted.is_empty() || wanted.contains(&format!("{n}x{m}")))
        .collect();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    println!(
        "{:>5} {:>8} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "n", "m", "round s", "keys s", "shares s", "masked s", "unmask s", "commit s"
    );
    for (n, m) in configs {
        runtime.block_on(bench(n, m))?;
    }
    Ok(())
}

async fn bench(n: usize, m: usize) -> anyhow::Result<()> {
    let (_dir, db) = sqlite_db();
    let limits =
        starling_coordinator::http::Limits { device: None, ip: None, ..Default::default() };
    let c = start_in_process_with(&db, limits).await?;
    let devices = enroll(&c.url, &c.admin, n).await?;
    let mut plan = PlanSpec {
        params: m as u64,
        cohort: n as u32,
        over_selection: 1.0,
        quorum: n as u32,
        selection_secs: 60.0,
        reporting_secs: 120.0,
        rounds: 1,
    }
    .json();
    plan["secure_aggregation"] =
        serde_json::json!({"clip": 1.0, "max_examples": 100, "stage_timeout_secs": 60.0});
    let run = RunId(c.admin.create_run(&plan).await?.id);
    wait_round_open(&c.admin, run, 0).await?;
    let tasks = expect_tasks(&devices).await?;
    let started = Instant::now();
    let mut sessions: Vec<SecureSession> = join_all(devices.iter().zip(&tasks).map(|(d, t)| {
        SecureSession::advertise(
            d,
            run,
            (t.round_idx, t.model_version),
            t.secure_aggregation.expect("secure"),
        )
    }))
    .await
    .into_iter()
    .collect::<Result<_, _>>()?;
    let keys = started.elapsed().as_secs_f64();
    join_all(sessions.iter_mut().zip(&devices).map(|(s, d)| s.share_keys(d)))
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    let shares = started.elapsed().as_secs_f64();
    let deltas: Vec<Vec<f32>> = (0..n).map(|i| delta(i, 0, m)).collect();
    join_all(
        sessions
            .iter_mut()
            .zip(&devices)
            .zip(&deltas)
            .enumerate()
            .map(|(i, ((s, d), delta))| s.send_masked(d, ModelVersion(0), delta, weight(i), None)),
    )
    .await
    .into_iter()
    .collect::<Result<Vec<_>, _>>()?;
    let masked = started.elapsed().as_secs_f64();
    join_all(sessions.iter_mut().zip(&devices).map(|(s, d)| s.unmask(d)))
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    let unmask_sent = started.elapsed().as_secs_f64();
    wait_model(&c.admin, run, 1).await?;
    let round = started.elapsed().as_secs_f64();
    println!(
        "{n:>5} {m:>8} {round:>8.2} {keys:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2}",
        shares - keys,
        masked - shares,
        unmask_sent - masked,
        round - unmask_sent,
    );
    c.running.shutdown().await?;
    Ok(())
}

//! The aggregator tier end to end: a coordinator, three `starling-aggregator` processes and
//! devices over real HTTP. The committed model equals, bit for bit, the model one coordinator
//! commits for the same updates (SQLite); a SIGKILLed aggregator costs exactly its own devices
//! (Postgres). Grouped, the three report one partial through their leader, and members of a
//! dead leader report alone. Groups of 2 to 4 CPU nodes sum their members' sums by the TCP
//! collective, and fall back to HTTP when a member dies. On a machine with two GPUs or more
//! and NCCL, a group of CUDA nodes sums by NCCL all-reduce; elsewhere that test says it
//! skipped.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use starling_client::protocol::FleetClient;
use starling_coordinator::tier::TierSettings;
use starling_core::compression::{Compression, ErrorFeedback};
use starling_core::fedavg::{FedAvgAccumulator, validate_update};
use starling_core::rng::SplitMix64;
use starling_core::tier::AggregatorHello;
use starling_core::wire::TICKET_HEADER;
use starling_core::wire::{ErrorCode, TaskAssignment, UploadRequest};
use starling_core::{AggregatorId, RunId};
use starling_tests::{
    InProcess, TestPki, api_code, enroll, expect_tasks, http_client, http_client_trusting,
    model_values, sqlite_db, start_in_process_configured, wait_aggregators_live, wait_for,
    wait_model,
};

const SECRET: &str = "tier-test-secret-0123456789";
const PARAMS: u64 = 20_000;

/// An aggregator node as a child process.
struct ChildAggregator {
    id: u32,
    child: Child,
}

impl ChildAggregator {
    fn spawn(id: u32, coordinator: &str) -> anyhow::Result<Self> {
        Self::spawn_with(id, coordinator, &[])
    }

    fn spawn_with(id: u32, coordinator: &str, extra: &[String]) -> anyhow::Result<Self> {
        Self::spawn_logging(id, coordinator, extra, Stdio::inherit())
    }

    fn spawn_logging(
        id: u32,
        coordinator: &str,
        extra: &[String],
        stderr: Stdio,
    ) -> anyhow::Result<Self> {
        let bin = Path::new(env!("CARGO_BIN_EXE_aggregator_under_test"));
        let mut child = Command::new(bin)
            .args([
                "--id",
                &id.to_string(),
                "--listen",
                "127.0.0.1:0",
                "--coordinator",
                coordinator,
            ])
            // CI has no GPU; on a GPU machine STARLING_TEST_AGGREGATOR_ENGINE=cuda runs the
            // same tests through the CUDA engine.
            .args([
                "--engine",
                &std::env::var("STARLING_TEST_AGGREGATOR_ENGINE").unwrap_or_else(|_| "cpu".into()),
            ])
            .args(["--threads", "2"])
            .args(if extra.iter().any(|a| a == "--tls-cert") {
                None
            } else {
                Some("--insecure-http")
            })
            .args(extra)
            .env("STARLING_AGGREGATOR_SECRET", SECRET)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line)?;
        anyhow::ensure!(line.contains("listening on"), "aggregator {id} did not start: {line:?}");
        Ok(ChildAggregator { id, child })
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ChildAggregator {
    fn drop(&mut self) {
        self.kill();
    }
}

async fn coordinator(db: &str, tier: bool) -> anyhow::Result<InProcess> {
    start_in_process_configured(db, &Default::default(), |c| {
        c.limits.device = None;
        c.tier = tier.then(|| TierSettings {
            secret: SECRET.to_owned(),
            cohort_threshold: 4,
            report_grace: Duration::from_secs(3),
            liveness: Duration::from_millis(1500),
        });
    })
    .await
}

fn plan(devices: u32, quorum: u32, reporting_secs: f64, rounds: u32) -> serde_json::Value {
    serde_json::json!({
        "model": {
            "schema": {"tensors": [{"name": "w", "shape": [PARAMS], "dtype": "f32"}]},
            "init": {"kind": "seeded", "seed": 42}
        },
        "training": {"optimizer": "sgd", "lr": 0.1},
        "cohort_size": devices, "over_selection": 1.0, "min_quorum": quorum,
        "selection_timeout_secs": reporting_secs, "reporting_timeout_secs": reporting_secs, "rounds": rounds,
    })
}

/// Device `i`'s update: arbitrary f32s (not exact in any sum), and an example count.
fn update(task: &TaskAssignment, i: usize) -> UploadRequest {
    let mut rng = SplitMix64(0x2545_f491_4f6c_dd1d ^ (i as u64 + 1));
    let delta: Vec<f32> = (0..PARAMS).map(|_| (rng.unit() as f32 - 0.5) * 0.3).collect();
    UploadRequest {
        model_version: task.model_version,
        example_count: 1 + (i as u64 * 37) % 300,
        metrics: [("loss".to_owned(), 0.5 + i as f64 / 100.0)].into(),
        delta: task.schema.encode_f32(&delta),
    }
}

/// Starts 3 aggregators and waits until the coordinator hands out tasks through them.
async fn aggregators(c: &InProcess) -> anyhow::Result<Vec<ChildAggregator>> {
    let nodes =
        (1..=3).map(|id| ChildAggregator::spawn(id, &c.url)).collect::<anyhow::Result<Vec<_>>>()?;
    wait_aggregators_live(&c.url, &http_client(), 3).await?;
    Ok(nodes)
}

/// What one coordinator alone commits for these updates: core's accumulator, in order.
fn single_node_model(global: &[f32], task: &TaskAssignment, updates: &[UploadRequest]) -> Vec<f32> {
    let mut acc = FedAvgAccumulator::new(global.len());
    for u in updates {
        acc.add(&validate_update(&task.schema, Compression::F32, u.clone()).unwrap());
    }
    acc.finish().unwrap().apply(global, 1.0).unwrap()
}

async fn run_and_tasks(
    c: &InProcess,
    devices: &[FleetClient],
    plan: &serde_json::Value,
) -> anyhow::Result<(RunId, Vec<TaskAssignment>)> {
    let run = RunId(c.admin.create_run(plan).await?.id);
    Ok((run, expect_tasks(devices).await?))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tiered_round_commits_the_single_coordinator_model() -> anyhow::Result<()> {
    let (_dir, db) = sqlite_db();
    let c = coordinator(&db, true).await?;
    let _nodes = aggregators(&c).await?;
    let devices = enroll(&c.url, &c.admin, 24).await?;
    let (run, tasks) = run_and_tasks(&c, &devices, &plan(24, 12, 30.0, 1)).await?;
    let targets: BTreeSet<AggregatorId> =
        tasks.iter().map(|t| t.upload_to.as_ref().expect("a tiered task").aggregator).collect();
    assert!(targets.len() >= 2, "24 devices hash onto several aggregators: {targets:?}");
    let global = model_values(&devices[0], &tasks[0].model_hash, &tasks[0].schema).await?;
    let updates: Vec<UploadRequest> = tasks.iter().enumerate().map(|(i, t)| update(t, i)).collect();

    // Refusals first: the coordinator sends a tiered device to its aggregator; an aggregator
    // refuses a missing or forged ticket, or one made out for another aggregator.
    assert_eq!(
        api_code(devices[0].upload(run, tasks[0].round_idx, &updates[0]).await),
        Some(ErrorCode::Conflict)
    );
    let target = tasks[0].upload_to.clone().unwrap();
    let url = format!("{}/v1/runs/{run}/rounds/{}/updates", target.url, tasks[0].round_idx);
    let http = http_client();
    // (Refused before the body is read: send none, or the server may close mid-body.)
    let no_ticket = http.post(&url).send().await?;
    assert_eq!(no_ticket.status(), 401);
    let forged = target.ticket.replacen(':', ":00", 1);
    let res = http.post(&url).header(TICKET_HEADER, forged).send().await?;
    assert_eq!(res.status(), 401);
    let other = tasks
        .iter()
        .position(|t| t.upload_to.as_ref().unwrap().aggregator != target.aggregator)
        .unwrap();
    let elsewhere = tasks[other].upload_to.as_ref().unwrap();
    let res = http.post(&url).header(TICKET_HEADER, &elsewhere.ticket).send().await?;
    assert_eq!(res.status(), 401, "a ticket for another aggregator");
    // The aggregation API wants the cluster secret.
    let hello = starling_core::codec::to_vec(&AggregatorHello {
        id: AggregatorId(9),
        url: "http://x".into(),
        engine: "cpu".into(),
    })?;
    let res = http
        .post(format!("{}/v1/aggregation/poll", c.url))
        .bearer_auth("wrong-secret-wrong-secret")
        .body(hello)
        .send()
        .await?;
    assert_eq!(res.status(), 401);

    // Every device uploads to its aggregator, concurrently.
    let sent = futures_util::future::join_all(devices.iter().zip(&tasks).zip(&updates).map(
        |((d, t), u)| d.upload_to_aggregator(t.upload_to.as_ref().unwrap(), run, t.round_idx, u),
    ))
    .await;
    for res in sent {
        res?;
    }
    // A second upload of the same device is a duplicate at its aggregator.
    let again = devices[1]
        .upload_to_aggregator(
            tasks[1].upload_to.as_ref().unwrap(),
            run,
            tasks[1].round_idx,
            &updates[1],
        )
        .await;
    assert!(matches!(
        api_code(again),
        Some(ErrorCode::DuplicateUpload) | Some(ErrorCode::RoundClosed)
    ));

    let hash = wait_model(&c.admin, run, 1).await?;
    let committed = model_values(&devices[0], &hash, &tasks[0].schema).await?;
    let round = c.admin.round(run, 0).await?;
    assert_eq!((round.n_reported.unwrap(), round.n_dropped), (24, Some(0)));
    assert_eq!(
        committed,
        single_node_model(&global, &tasks[0], &updates),
        "tiered = one node, bit for bit"
    );
    let loss = round.metrics.as_ref().and_then(|m| m.get("loss")).copied();
    assert!(loss.is_some(), "the partials carry the metrics: {:?}", round.metrics);
    // The admin API tells which aggregator took each device and that its update came through
    // that aggregator's partial.
    let record = c.admin.round_devices(run, 0).await?;
    assert_eq!(record.len(), 24);
    assert!(record.iter().all(|d| d.reported.as_deref() == Some("partial")), "{record:?}");
    assert!(record.iter().all(|d| d.example_count.is_none()), "{record:?}");
    let mut recorded: Vec<Option<i64>> = record.iter().map(|d| d.aggregator_id).collect();
    let mut assigned: Vec<Option<i64>> =
        tasks.iter().map(|t| t.upload_to.as_ref().map(|u| i64::from(u.aggregator.0))).collect();
    recorded.sort();
    assigned.sort();
    assert_eq!(recorded, assigned);

    // The same updates through a coordinator without a tier commit the same bits.
    let (_dir2, db2) = sqlite_db();
    let plain = coordinator(&db2, false).await?;
    let plain_devices = enroll(&plain.url, &plain.admin, 24).await?;
    let (plain_run, plain_tasks) =
        run_and_tasks(&plain, &plain_devices, &plan(24, 12, 30.0, 1)).await?;
    assert!(plain_tasks.iter().all(|t| t.upload_to.is_none()));
    for ((d, t), u) in plain_devices.iter().zip(&plain_tasks).zip(&updates) {
        d.upload(plain_run, t.round_idx, u).await?;
    }
    let plain_hash = wait_model(&plain.admin, plain_run, 1).await?;
    let plain_model = model_values(&plain_devices[0], &plain_hash, &plain_tasks[0].schema).await?;
    assert_eq!(plain_model, committed);
    Ok(())
}

/// Issue 51 item 4: the tier reduced f32 deltas only, so an int8 run's 10 000 devices all
/// uploaded to the coordinator (15.7 s a round, against 7.9 s for f32 through two
/// aggregators). Now an aggregator validates a delta in the run's encoding and reduces its
/// decoded values: a tiered int8 round commits what the coordinator alone commits for the same
/// bytes, and an aggregator refuses a delta in another encoding as the coordinator does.
#[tokio::test(flavor = "multi_thread")]
async fn an_int8_tiered_round_commits_what_the_coordinator_alone_commits() -> anyhow::Result<()> {
    let compression = Compression::Int8 { block: 64 };
    let mut int8_plan = plan(24, 24, 30.0, 1);
    int8_plan["compression"] = serde_json::to_value(compression)?;
    let encoded = |task: &TaskAssignment, i: usize| -> anyhow::Result<UploadRequest> {
        let mut u = update(task, i);
        let values = task.schema.decode_f32(&u.delta)?;
        let mut feedback = ErrorFeedback::default();
        u.delta.data = compression.encode(&values, &mut SplitMix64(i as u64), &mut feedback);
        Ok(u)
    };
    let (_dir, db) = sqlite_db();
    let c = coordinator(&db, true).await?;
    let _nodes = aggregators(&c).await?;
    let devices = enroll(&c.url, &c.admin, 24).await?;
    let (run, tasks) = run_and_tasks(&c, &devices, &int8_plan).await?;
    assert!(tasks.iter().all(|t| t.upload_to.is_some() && t.compression == compression));
    let f32_delta = devices[0]
        .upload_to_aggregator(
            tasks[0].upload_to.as_ref().unwrap(),
            run,
            tasks[0].round_idx,
            &update(&tasks[0], 0),
        )
        .await;
    assert_eq!(api_code(f32_delta), Some(ErrorCode::ShapeMismatch), "an f32 delta to an int8 run");
    let updates: Vec<UploadRequest> =
        tasks.iter().enumerate().map(|(i, t)| encoded(t, i)).collect::<anyhow::Result<_>>()?;
    for ((d, t), u) in devices.iter().zip(&tasks).zip(&updates) {
        d.upload_to_aggregator(t.upload_to.as_ref().unwrap(), run, t.round_idx, u).await?;
    }
    let hash = wait_model(&c.admin, run, 1).await?;
    let tiered = model_values(&devices[0], &hash, &tasks[0].schema).await?;
    let round = c.admin.round(run, 0).await?;
    assert_eq!((round.n_reported, round.n_dropped), (Some(24), Some(0)));

    let (_dir2, db2) = sqlite_db();
    let plain = coordinator(&db2, false).await?;
    let plain_devices = enroll(&plain.url, &plain.admin, 24).await?;
    let (plain_run, plain_tasks) = run_and_tasks(&plain, &plain_devices, &int8_plan).await?;
    for ((d, t), u) in plain_devices.iter().zip(&plain_tasks).zip(&updates) {
        d.upload(plain_run, t.round_idx, u).await?;
    }
    let plain_hash = wait_model(&plain.admin, plain_run, 1).await?;
    let alone = model_values(&plain_devices[0], &plain_hash, &plain_tasks[0].schema).await?;
    assert_eq!(tiered, alone, "tiered int8 = the coordinator alone, bit for bit");
    Ok(())
}

/// Aggregators served plain HTTP, so a TLS coordinator sent devices' updates (and
/// aggregators the cluster secret) in clear. Now a TLS coordinator refuses an aggregator that
/// offers plain HTTP; a TLS aggregator serves devices over TLS and speaks only https to the
/// coordinator, verified against its CA; and the SDK refuses to send an update to a plain-HTTP
/// target that an https coordinator handed it.
#[tokio::test(flavor = "multi_thread")]
async fn a_tls_coordinators_tier_is_tls_end_to_end() -> anyhow::Result<()> {
    let pki = TestPki::new()?;
    let (_dir, db) = sqlite_db();
    let device_tls = pki.client_tls("ca.pem", None)?;
    let c = start_in_process_configured(&db, &device_tls, |c| {
        c.limits.device = None;
        c.tls = Some(pki.server_tls(false));
        c.tier = Some(TierSettings {
            secret: SECRET.to_owned(),
            cohort_threshold: 4,
            report_grace: Duration::from_secs(3),
            liveness: Duration::from_millis(1500),
        });
    })
    .await?;
    let hello = AggregatorHello {
        id: AggregatorId(9),
        url: "http://127.0.0.1:1".into(),
        engine: "cpu".into(),
    };
    let res = http_client_trusting(&pki.path("ca.pem"))?
        .post(format!("{}/v1/aggregation/poll", c.url))
        .bearer_auth(SECRET)
        .header("content-type", starling_core::wire::CBOR_MEDIA_TYPE)
        .body(starling_core::codec::to_vec(&hello)?)
        .send()
        .await?;
    assert_eq!(res.status(), 422, "a plain-HTTP aggregator is refused");
    let path = |name: &str| pki.path(name).display().to_string();
    let tls_args = [
        "--tls-cert",
        &path("server.pem"),
        "--tls-key",
        &path("server.key"),
        "--ca-cert",
        &path("ca.pem"),
    ]
    .map(str::to_owned);
    let _node = ChildAggregator::spawn_with(1, &c.url, &tls_args)?;
    wait_aggregators_live(&c.url, &http_client_trusting(&pki.path("ca.pem"))?, 1).await?;
    let token = c.admin.enrollment_token(1_000_000).await?;
    let mut devices = vec![];
    for _ in 0..8 {
        let mut d = FleetClient::with_tls(&c.url, &device_tls)?;
        d.enroll(&token).await?;
        devices.push(d);
    }
    let run = RunId(c.admin.create_run(&plan(8, 8, 30.0, 1)).await?.id);
    let tasks = expect_tasks(&devices).await?;
    assert!(
        tasks.iter().all(|t| t.upload_to.as_ref().is_some_and(|u| u.url.starts_with("https://")))
    );
    let updates: Vec<UploadRequest> = tasks.iter().enumerate().map(|(i, t)| update(t, i)).collect();
    // A target rewritten to plain HTTP is refused before anything is sent.
    let mut downgraded = tasks[0].upload_to.clone().unwrap();
    downgraded.url = downgraded.url.replacen("https://", "http://", 1);
    let refused =
        devices[0].upload_to_aggregator(&downgraded, run, tasks[0].round_idx, &updates[0]).await;
    assert!(
        matches!(&refused, Err(starling_client::protocol::ClientError::Tls(m)) if m.contains("in clear")),
        "{refused:?}"
    );
    for ((d, t), u) in devices.iter().zip(&tasks).zip(&updates) {
        d.upload_to_aggregator(t.upload_to.as_ref().unwrap(), run, t.round_idx, u).await?;
    }
    wait_model(&c.admin, run, 1).await?;
    let round = c.admin.round(run, 0).await?;
    assert_eq!((round.n_reported.unwrap(), round.n_dropped), (8, Some(0)));
    Ok(())
}

/// Device indices by the aggregator their task sends them to.
fn devices_by_node(tasks: &[TaskAssignment]) -> BTreeMap<u32, Vec<usize>> {
    let mut by_node: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for (i, t) in tasks.iter().enumerate() {
        by_node.entry(t.upload_to.as_ref().unwrap().aggregator.0).or_default().push(i);
    }
    by_node
}

/// Every device uploads except one per node (so no node reports before the deadline); returns
/// the updates that reached nodes other than `victim`.
async fn upload_all_but_holdouts(
    devices: &[FleetClient],
    tasks: &[TaskAssignment],
    run: RunId,
    by_node: &BTreeMap<u32, Vec<usize>>,
    victim: u32,
) -> anyhow::Result<Vec<UploadRequest>> {
    let holdouts: BTreeSet<usize> = by_node.values().map(|v| v[0]).collect();
    let mut survivors = vec![];
    for (i, (d, t)) in devices.iter().zip(tasks).enumerate() {
        if holdouts.contains(&i) {
            continue;
        }
        let u = update(t, i);
        let target = t.upload_to.as_ref().unwrap();
        d.upload_to_aggregator(target, run, t.round_idx, &u).await?;
        if target.aggregator.0 != victim {
            survivors.push(u);
        }
    }
    Ok(survivors)
}

/// On Postgres: the partials and assignments go through the production store.
#[sqlx::test(migrations = false)]
async fn a_killed_aggregator_loses_only_its_devices(
    _pool: sqlx::postgres::PgPoolOptions,
    opts: sqlx::postgres::PgConnectOptions,
) -> anyhow::Result<()> {
    let c = coordinator(&starling_tests::pg_url(&opts), true).await?;
    let mut nodes = aggregators(&c).await?;
    let devices = enroll(&c.url, &c.admin, 24).await?;
    let (run, tasks) = run_and_tasks(&c, &devices, &plan(24, 8, 5.0, 2)).await?;
    let global = model_values(&devices[0], &tasks[0].model_hash, &tasks[0].schema).await?;
    let by_node = devices_by_node(&tasks);
    // The victim: the node with the most devices. One device of every node holds back, so no
    // node reports early; the victim dies with its uploads in memory.
    let victim = *by_node.iter().max_by_key(|(_, v)| v.len()).unwrap().0;
    let survivors = upload_all_but_holdouts(&devices, &tasks, run, &by_node, victim).await?;
    nodes.iter_mut().find(|n| n.id == victim).unwrap().kill();

    let hash = wait_model(&c.admin, run, 1).await?;
    let round = c.admin.round(run, 0).await?;
    let lost = by_node[&victim].len() as i64;
    assert_eq!(
        round.n_reported.unwrap(),
        24 - lost - 2,
        "the victim's devices and the survivors' holdouts are missing"
    );
    assert_eq!(round.n_dropped, Some(lost + 2));
    let committed = model_values(&devices[0], &hash, &tasks[0].schema).await?;
    assert_eq!(committed, single_node_model(&global, &tasks[0], &survivors));

    // The next round assigns devices only to the live aggregators.
    wait_aggregators_live(&c.url, &http_client(), 2).await?;
    let next = expect_tasks(&devices).await?;
    let used: BTreeSet<u32> =
        next.iter().map(|t| t.upload_to.as_ref().unwrap().aggregator.0).collect();
    assert!(!used.contains(&victim), "{used:?} includes the dead aggregator {victim}");
    assert_eq!(next[0].round_idx.0, 1);
    c.admin.stop(run).await?;
    Ok(())
}

/// Every device uploads its update to its aggregator; the round commits with all 24 of them.
/// The updates, and the committed model's hash.
async fn upload_all_and_commit(
    c: &InProcess,
    devices: &[FleetClient],
    tasks: &[TaskAssignment],
    run: RunId,
) -> anyhow::Result<(Vec<UploadRequest>, String)> {
    let updates: Vec<UploadRequest> = tasks.iter().enumerate().map(|(i, t)| update(t, i)).collect();
    for ((d, t), u) in devices.iter().zip(tasks).zip(&updates) {
        d.upload_to_aggregator(t.upload_to.as_ref().unwrap(), run, t.round_idx, u).await?;
    }
    let hash = wait_model(&c.admin, run, 1).await?;
    let round = c.admin.round(run, 0).await?;
    assert_eq!((round.n_reported.unwrap(), round.n_dropped), (24, Some(0)));
    Ok((updates, hash))
}

/// Three aggregators in group "rack" (ids 1-3, ranks 0-2: node 1 leads), once the members
/// found their leader through the coordinator.
async fn grouped_aggregators(c: &InProcess) -> anyhow::Result<Vec<ChildAggregator>> {
    let nodes = (1..=3u32)
        .map(|id| {
            let group = ["--group", "rack", "--rank", &(id - 1).to_string(), "--world-size", "3"];
            let extra: Vec<String> = group.iter().map(|s| s.to_string()).collect();
            ChildAggregator::spawn_with(
                id,
                &c.url,
                &[extra, vec!["--group-wait-ms".into(), "1000".into()]].concat(),
            )
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    // The leader publishes on its first poll; members look it up on each poll until found
    // (and again at a round's end, when they have not).
    wait_aggregators_live(&c.url, &http_client(), 3).await?;
    let rendezvous = format!("{}/v1/aggregation/groups/rack", c.url);
    wait_for("the group's leader to publish", Duration::from_secs(30), || async {
        let res = http_client().get(&rendezvous).bearer_auth(SECRET).send().await?;
        Ok(res.status().is_success().then_some(()))
    })
    .await?;
    Ok(nodes)
}

/// The aggregator lists of a round's stored partials.
async fn stored_partials(db: &str, run: RunId) -> anyhow::Result<Vec<Vec<u32>>> {
    let pool = sqlx::SqlitePool::connect(db).await?;
    let rows: Vec<(String,)> = sqlx::query_as(
        "SELECT aggregators_json FROM partials WHERE run_id = ? AND round_idx = 0 ORDER BY slot",
    )
    .bind(run.0)
    .fetch_all(&pool)
    .await?;
    rows.iter().map(|(json,)| Ok(serde_json::from_str(json)?)).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_group_reports_one_partial_for_its_members() -> anyhow::Result<()> {
    use starling_core::tier::GroupRendezvous;
    let (_dir, db) = sqlite_db();
    let c = coordinator(&db, true).await?;
    let _nodes = grouped_aggregators(&c).await?;

    // The rendezvous, as the members read it; and what the endpoint refuses.
    let http = http_client();
    let groups = format!("{}/v1/aggregation/groups", c.url);
    let res = http.get(format!("{groups}/rack")).bearer_auth(SECRET).send().await?;
    assert_eq!(res.status(), 200);
    let doc: GroupRendezvous = starling_core::codec::decode(&res.bytes().await?)?;
    assert_eq!((doc.leader, doc.world_size, doc.nccl_id.is_some()), (AggregatorId(1), 3, false));
    let res =
        http.get(format!("{groups}/rack")).bearer_auth("wrong-secret-wrong-secret").send().await?;
    assert_eq!(res.status(), 401);
    let res = http.get(format!("{groups}/nobody")).bearer_auth(SECRET).send().await?;
    assert_eq!(res.status(), 404);
    let res = http.get(format!("{groups}/bad!name")).bearer_auth(SECRET).send().await?;
    assert_eq!(res.status(), 400);
    let lonely = GroupRendezvous { world_size: 1, ..doc.clone() };
    let res = http
        .put(format!("{groups}/other"))
        .bearer_auth(SECRET)
        .body(starling_core::codec::to_vec(&lonely)?)
        .send()
        .await?;
    assert_eq!(res.status(), 422);

    let devices = enroll(&c.url, &c.admin, 24).await?;
    let (run, tasks) = run_and_tasks(&c, &devices, &plan(24, 12, 30.0, 1)).await?;
    let targets: BTreeSet<u32> =
        tasks.iter().map(|t| t.upload_to.as_ref().expect("a tiered task").aggregator.0).collect();
    assert_eq!(targets, BTreeSet::from([1, 2, 3]), "24 devices reach every node");
    let global = model_values(&devices[0], &tasks[0].model_hash, &tasks[0].schema).await?;

    // On CPUs there is no NCCL communicator: the leader turns an offer to sum by collective
    // down (the member then hands its sums over HTTP), and checks the offer like a hand-off.
    let offer_url = format!("{}/v1/group/runs/{run}/rounds/0/collective", doc.leader_url);
    let metadata = starling_core::tier::PartialReport {
        model_version: tasks[0].model_version,
        schema_id: tasks[0].schema.schema_id(),
        aggregators: vec![AggregatorId(2)],
        devices: vec![starling_core::DeviceId(1)],
        total_weight: 10,
        sum_hi: vec![],
        sum_lo: vec![],
        metrics: Default::default(),
    };
    let offer = starling_core::codec::to_vec(&starling_aggregator::group::CollectiveOffer {
        comm: 7,
        report: metadata,
    })?;
    let res = http.post(&offer_url).bearer_auth(SECRET).body(offer.clone()).send().await?;
    assert_eq!(res.status(), 409);
    let why: starling_core::wire::ErrorBody = starling_core::codec::decode(&res.bytes().await?)?;
    assert_eq!(why.code, ErrorCode::Conflict, "{}", why.message);
    let res =
        http.post(&offer_url).bearer_auth("wrong-secret-wrong-secret").body(offer).send().await?;
    assert_eq!(res.status(), 401);
    let res = http.post(&offer_url).bearer_auth(SECRET).body(vec![0xff, 0x00]).send().await?;
    assert_eq!(res.status(), 400);

    let (updates, hash) = upload_all_and_commit(&c, &devices, &tasks, run).await?;
    let committed = model_values(&devices[0], &hash, &tasks[0].schema).await?;
    assert_eq!(committed, single_node_model(&global, &tasks[0], &updates), "bit for bit");
    assert_eq!(
        stored_partials(&db, run).await?,
        vec![vec![1, 2, 3]],
        "one partial, from the leader, for the whole group"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn members_of_a_dead_group_leader_report_alone() -> anyhow::Result<()> {
    let (_dir, db) = sqlite_db();
    let c = coordinator(&db, true).await?;
    let mut nodes = grouped_aggregators(&c).await?;
    let devices = enroll(&c.url, &c.admin, 24).await?;
    let (run, tasks) = run_and_tasks(&c, &devices, &plan(24, 8, 5.0, 1)).await?;
    let global = model_values(&devices[0], &tasks[0].model_hash, &tasks[0].schema).await?;
    let by_node = devices_by_node(&tasks);
    assert_eq!(by_node.len(), 3, "every node has devices: {by_node:?}");
    // Shards end at the deadline; the leader (node 1) dies before then, with its devices'
    // uploads.
    let survivors = upload_all_but_holdouts(&devices, &tasks, run, &by_node, 1).await?;
    nodes.iter_mut().find(|n| n.id == 1).unwrap().kill();

    let hash = wait_model(&c.admin, run, 1).await?;
    let round = c.admin.round(run, 0).await?;
    let lost = by_node[&1].len() as i64;
    assert_eq!(round.n_reported.unwrap(), 24 - lost - 2, "the leader's devices and two holdouts");
    assert_eq!(round.n_dropped, Some(lost + 2));
    let committed = model_values(&devices[0], &hash, &tasks[0].schema).await?;
    assert_eq!(committed, single_node_model(&global, &tasks[0], &survivors));
    assert_eq!(
        stored_partials(&db, run).await?.into_iter().collect::<BTreeSet<_>>(),
        BTreeSet::from([vec![2], vec![3]]),
        "each member reported its own shard"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_gpu_group_sums_its_members_by_nccl_all_reduce() -> anyhow::Result<()> {
    const TEST: &str = "a_gpu_group_sums_its_members_by_nccl_all_reduce";
    // NCCL puts one rank on one GPU, so a group needs two GPUs at least.
    let gpus = match starling_aggregator::gpu::probe() {
        Ok(info) if info.devices >= 2 && starling_aggregator::gpu::nccl_present() => info.devices,
        Ok(info) => {
            let nccl = starling_aggregator::gpu::nccl_present();
            let why = format!("{} GPU(s), NCCL present: {nccl}", info.devices);
            starling_core::skipped::skipped(TEST, &why);
            return Ok(());
        }
        Err(e) => {
            starling_core::skipped::skipped(TEST, &format!("no GPU: {e}"));
            return Ok(());
        }
    };
    let size = gpus.min(3) as u32;
    let (_dir, db) = sqlite_db();
    let c = coordinator(&db, true).await?;
    let group = CollectiveGroup::start(&c, size, 1..=size, |rank| {
        vec!["--engine".into(), "cuda".into(), "--gpu".into(), rank.to_string()]
    })?;
    group.joined().await?;
    all_reduced_round(&c, &db, &group).await
}

/// CPU nodes in groups of 2, 3 and 4 run the whole collective path (communicator ids through
/// the rendezvous, joins, offers, one turn, the all-reduce, the merged report) over the TCP
/// collective: what a group of CUDA nodes does over NCCL, here on any machine.
#[tokio::test(flavor = "multi_thread")]
async fn cpu_groups_of_two_to_four_sum_their_members_by_tcp_all_reduce() -> anyhow::Result<()> {
    for size in 2..=4u32 {
        let (_dir, db) = sqlite_db();
        let c = coordinator(&db, true).await?;
        let group = CollectiveGroup::start(&c, size, 1..=size, tcp)?;
        group.joined().await?;
        all_reduced_round(&c, &db, &group).await?;
    }
    Ok(())
}

/// A TCP group whose member died after the communicator was up: the leader turns the other
/// member's offer down at its deadline, takes its sums over HTTP instead, and reports the two
/// live nodes' shards merged, exactly; only the dead member's devices are lost.
#[tokio::test(flavor = "multi_thread")]
async fn a_tcp_group_with_a_dead_member_sums_the_rest_over_http() -> anyhow::Result<()> {
    let (_dir, db) = sqlite_db();
    let c = coordinator(&db, true).await?;
    let mut group = CollectiveGroup::start(&c, 3, 1..=3, tcp)?;
    group.joined().await?;
    let devices = enroll(&c.url, &c.admin, 24).await?;
    let (run, tasks) = run_and_tasks(&c, &devices, &plan(24, 8, 5.0, 1)).await?;
    let global = model_values(&devices[0], &tasks[0].model_hash, &tasks[0].schema).await?;
    let by_node = devices_by_node(&tasks);
    assert_eq!(by_node.len(), 3, "every node has devices: {by_node:?}");
    let survivors = upload_all_but_holdouts(&devices, &tasks, run, &by_node, 3).await?;
    group.nodes.iter_mut().find(|n| n.id == 3).unwrap().kill();

    let hash = wait_model(&c.admin, run, 1).await?;
    let round = c.admin.round(run, 0).await?;
    let lost = by_node[&3].len() as i64;
    assert_eq!(
        round.n_reported.unwrap(),
        24 - lost - 2,
        "the dead member's devices and two holdouts"
    );
    let committed = model_values(&devices[0], &hash, &tasks[0].schema).await?;
    assert_eq!(committed, single_node_model(&global, &tasks[0], &survivors), "bit for bit");
    assert_eq!(stored_partials(&db, run).await?, vec![vec![1, 2]], "one partial for the two");
    let leader_log = group.log(1);
    assert!(leader_log.contains("reporting without every member's shard"), "{leader_log}");
    assert!(!leader_log.contains("the group's sums were all-reduced"), "{leader_log}");
    Ok(())
}

/// A node's arguments for the TCP collective.
fn tcp(_rank: u32) -> Vec<String> {
    vec!["--collective".into(), "tcp".into()]
}

/// A group "rack" of `size` nodes summing by collective (ids 1..=size, rank = id − 1), of which
/// `started` run, each logging to a file of its own.
struct CollectiveGroup {
    nodes: Vec<ChildAggregator>,
    logs: tempfile::TempDir,
    size: u32,
}

impl CollectiveGroup {
    fn start(
        c: &InProcess,
        size: u32,
        started: std::ops::RangeInclusive<u32>,
        args: impl Fn(u32) -> Vec<String>,
    ) -> anyhow::Result<Self> {
        let logs = tempfile::tempdir()?;
        let nodes = started
            .map(|id| {
                let rank = id - 1;
                let group = ["--group", "rack", "--rank", &rank.to_string()];
                let size = ["--world-size".to_owned(), size.to_string()];
                let wait = ["--group-wait-ms", "1000"];
                let extra: Vec<String> = group
                    .iter()
                    .chain(&wait)
                    .map(|s| s.to_string())
                    .chain(size)
                    .chain(args(rank))
                    .collect();
                let log = std::fs::File::create(logs.path().join(format!("aggregator-{id}.log")))?;
                ChildAggregator::spawn_logging(id, &c.url, &extra, Stdio::from(log))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(CollectiveGroup { nodes, logs, size })
    }

    /// Node `id`'s log so far.
    fn log(&self, id: u32) -> String {
        std::fs::read_to_string(self.logs.path().join(format!("aggregator-{id}.log")))
            .unwrap_or_default()
    }

    /// Waits (at most 90 s) until every node says it is on the communicator the leader
    /// published.
    async fn joined(&self) -> anyhow::Result<()> {
        let on_it = |id| self.log(id).contains("on the group's communicator");
        wait_for("the group to join its communicator", Duration::from_secs(90), || async {
            Ok((1..=self.size).all(on_it).then_some(()))
        })
        .await
    }
}

/// A round of 24 devices through a joined group: one partial for all its nodes, summed by
/// the all-reduce, within f32 resolution of the exact merge (the collective adds high and low
/// parts apart).
async fn all_reduced_round(c: &InProcess, db: &str, group: &CollectiveGroup) -> anyhow::Result<()> {
    let devices = enroll(&c.url, &c.admin, 24).await?;
    let (run, tasks) = run_and_tasks(c, &devices, &plan(24, 12, 30.0, 1)).await?;
    let global = model_values(&devices[0], &tasks[0].model_hash, &tasks[0].schema).await?;
    let (updates, hash) = upload_all_and_commit(c, &devices, &tasks, run).await?;
    assert_eq!(stored_partials(db, run).await?, vec![(1..=group.size).collect::<Vec<_>>()]);
    let leader_log = group.log(1);
    assert!(leader_log.contains("the group's sums were all-reduced"), "{leader_log}");
    let committed = model_values(&devices[0], &hash, &tasks[0].schema).await?;
    let exact = single_node_model(&global, &tasks[0], &updates);
    for (i, (x, y)) in committed.iter().zip(&exact).enumerate() {
        assert!((x - y).abs() <= y.abs() * f32::EPSILON, "parameter {i}: {x} vs {y}");
    }
    Ok(())
}

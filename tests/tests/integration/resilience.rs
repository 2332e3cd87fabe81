//! What an outside tester's hostile-input, lost-reply and flood probes found, one test per
//! behaviour: each failed before its fix.

use std::time::Duration;

use starling_core::RunId;
use starling_core::wire::ErrorCode;
use starling_tests::*;

/// A device whose upload's answer was lost retries it after the round closed: it is answered
/// `duplicate_upload` (the update was counted), not `round_closed`, so the SDK keeps the top-k
/// residual it sent instead of sending those values again. Both while the run goes on (round 0
/// of two) and after the run's last round finished it. On both stores: Postgres once answered
/// these 503 (its `SELECT 1` is a 32-bit integer, read as 64), which made an SDK device retry a
/// finished upload until it gave up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_retried_after_its_round_closed_is_a_duplicate_not_a_late_upload_sqlite() {
    let (_dir, db) = sqlite_db();
    retried_after_close_is_a_duplicate(&db).await;
}

#[sqlx::test(migrations = false)]
async fn an_upload_retried_after_its_round_closed_is_a_duplicate_not_a_late_upload_postgres(
    _pool: sqlx::postgres::PgPoolOptions,
    opts: sqlx::postgres::PgConnectOptions,
) {
    retried_after_close_is_a_duplicate(&pg_url(&opts)).await;
}

async fn retried_after_close_is_a_duplicate(db: &str) {
    let c = start_in_process(db).await.unwrap();
    let devices = enroll(&c.url, &c.admin, 2).await.unwrap();
    let spec = PlanSpec::all_of(2, 64, 2);
    let run = RunId(c.admin.create_run(&spec.json()).await.unwrap().id);
    for round in 0..2 {
        wait_round_open(&c.admin, run, round).await.unwrap();
        let tasks = expect_tasks(&devices).await.unwrap();
        let requests: Vec<_> =
            (0..2).map(|i| upload_request(&tasks[i], &delta(i, round, 64), weight(i))).collect();
        for (i, d) in devices.iter().enumerate() {
            // Acknowledged; the device never sees the answer.
            d.upload(run, tasks[i].round_idx, &requests[i]).await.unwrap();
        }
        wait_model(&c.admin, run, round + 1).await.unwrap();
        if round == 1 {
            wait_for("the run to finish", Duration::from_secs(30), || async {
                Ok((c.admin.run(run).await?.status == "finished").then_some(()))
            })
            .await
            .unwrap();
        }
        let retried = devices[0].upload(run, tasks[0].round_idx, &requests[0]).await;
        assert_eq!(api_code(retried), Some(ErrorCode::DuplicateUpload), "round {round}");
    }
    c.running.shutdown().await.unwrap();
}

/// Opens a connection that sends nothing (`http2`: the HTTP/2 preface and an empty SETTINGS
/// frame, then nothing).
fn quiet_connection(addr: std::net::SocketAddr, http2: bool) -> std::net::TcpStream {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    if http2 {
        stream
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
            .unwrap();
    }
    stream
}

/// Whether the server closed `stream` (end of file or reset) before `deadline`.
fn closed_by_server(stream: &mut std::net::TcpStream, deadline: std::time::Instant) -> bool {
    use std::io::Read;
    let mut buf = [0u8; 256];
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return false;
        }
        stream.set_read_timeout(Some(left)).unwrap();
        match stream.read(&mut buf) {
            Ok(0) => return true,
            // The server's own SETTINGS and acknowledgements on an HTTP/2 connection.
            Ok(_) => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return false;
            }
            Err(_) => return true,
        }
    }
}

/// Two freshly enrolled devices take part in a one-round run at `url` and it commits.
async fn a_round_of_two_devices_commits(url: &str) {
    let admin = starling_client::protocol::AdminClient::new(url, OPERATOR_TOKEN);
    let devices = enroll(url, &admin, 2).await.unwrap();
    let run = RunId(admin.create_run(&one_round_plan(64, 2)).await.unwrap().id);
    wait_round_open(&admin, run, 0).await.unwrap();
    let tasks = expect_tasks(&devices).await.unwrap();
    for (i, (d, t)) in devices.iter().zip(&tasks).enumerate() {
        d.upload(run, t.round_idx, &upload_request(t, &delta(i, 0, 64), weight(i))).await.unwrap();
    }
    wait_model(&admin, run, 1).await.unwrap();
}

/// A flood of connections that send nothing, or open HTTP/2 and go quiet, used to hold every
/// file descriptor of the coordinator (2 100 on a 2 048-descriptor coordinator stopped it
/// answering anything, health probes included). Here 440 on a coordinator allowed 400 open
/// files: `/readyz` still answers and a device round completes while they are open (the
/// longest-silent connections are closed to make room), and every one of them is closed by the
/// server within its first-byte or idle deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_silent_and_idle_http2_connections_locks_no_one_out() {
    let (dir, db) = sqlite_db();
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_coordinator_under_test"));
    let listen = free_addr();
    let args = ["--header-timeout-secs", "6", "--idle-timeout-secs", "6"];
    let log = dir.path().join("coordinator.log");
    let coordinator =
        ChildCoordinator::spawn_with_nofile(bin, &db, listen, &log, 400, &args).await.unwrap();
    let flood: Vec<_> = tokio::task::spawn_blocking(move || {
        (0..440).map(|i| quiet_connection(listen, i % 2 == 1)).collect::<Vec<_>>()
    })
    .await
    .unwrap();
    let flooded = std::time::Instant::now();

    // The probe, well before any flood connection's deadline.
    let http = reqwest::Client::builder().timeout(Duration::from_secs(1)).build().unwrap();
    let ready = wait_for("/readyz during the flood", Duration::from_secs(4), || async {
        let res = http.get(format!("{}/readyz", coordinator.url)).send().await;
        Ok(res.ok().filter(|r| r.status().is_success()).map(|_| ()))
    })
    .await;
    let log_text = || std::fs::read_to_string(&log).unwrap_or_default();
    ready.unwrap_or_else(|e| panic!("{e}; coordinator log:\n{}", log_text()));
    assert!(flooded.elapsed() < Duration::from_secs(6), "answered only once the deadlines passed");

    // A device round, with the flood still open.
    a_round_of_two_devices_commits(&coordinator.url).await;

    // Every flood connection is closed by the server: evicted, or past its 6 s deadline.
    let deadline = flooded + Duration::from_secs(15);
    let still_open = tokio::task::spawn_blocking(move || {
        flood
            .into_iter()
            .filter_map(|mut s| (!closed_by_server(&mut s, deadline)).then_some(s))
            .count()
    })
    .await
    .unwrap();
    assert_eq!(still_open, 0, "connections the server never closed");
}

/// A TCP proxy on loopback that can be cut: from then on it forwards nothing either way but
/// keeps every socket open, as a network partition looks to both ends (no FIN, no RST).
struct CuttableProxy {
    addr: std::net::SocketAddr,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl CuttableProxy {
    async fn start(upstream: std::net::SocketAddr) -> Self {
        use std::sync::atomic::{AtomicBool, Ordering};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cut = std::sync::Arc::new(AtomicBool::new(false));
        let flag = cut.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(upstream).await else { continue };
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                for (mut from, mut to) in [(client_read, server_write), (server_read, client_write)]
                {
                    let cut = flag.clone();
                    tokio::spawn(async move {
                        use tokio::io::{AsyncReadExt, AsyncWriteExt};
                        let mut buf = vec![0u8; 16 * 1024];
                        loop {
                            let n = match from.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => n,
                            };
                            if cut.load(Ordering::SeqCst) {
                                // Partitioned: hold both sockets, forward nothing, ever.
                                std::future::pending::<()>().await;
                            }
                            if to.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    });
                }
            }
        });
        CuttableProxy { addr, cut }
    }

    fn cut(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// How a standby is expected to take over a leader that stopped renewing: the lease, a standby
/// poll, and the new leader's start (recovering runs), with room for a loaded CI machine.
fn takeover_bound() -> Duration {
    starling_coordinator::store::LEASE
        + starling_coordinator::store::STANDBY_POLL
        + Duration::from_secs(8)
}

/// Two coordinators on one Postgres; the leader acknowledges half a round's updates, then
/// `stall` makes it stop renewing its lease (SIGSTOP, or its database connections cut). The
/// standby serves within [`takeover_bound`], the round commits with every acknowledged update
/// (to the bit), and the old leader stops by itself without writing (the epoch fence) — it
/// used to block failover for as long as Postgres kept its session (two hours of keepalives).
async fn a_standby_replaces_a_leader_that_stops_renewing(
    url: &str,
    leader_url: &str,
    stall: impl FnOnce(&mut ChildCoordinator),
    resume: impl FnOnce(&mut ChildCoordinator),
) {
    use starling_core::RoundIdx;
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_coordinator_under_test"));
    let logs = tempfile::tempdir().unwrap();
    let mut leader =
        ChildCoordinator::spawn(bin, leader_url, free_addr(), &logs.path().join("a.log"))
            .await
            .unwrap();
    let standby =
        ChildCoordinator::spawn_standby(bin, url, free_addr(), &logs.path().join("b.log"))
            .await
            .unwrap();
    let admin = starling_client::protocol::AdminClient::new(&leader.url, OPERATOR_TOKEN);
    let mut devices = enroll(&leader.url, &admin, 4).await.unwrap();
    let run = RunId(admin.create_run(&one_round_plan(64, 4)).await.unwrap().id);
    wait_round_open(&admin, run, 0).await.unwrap();
    let tasks = expect_tasks(&devices).await.unwrap();
    let global = model_values(&devices[0], &tasks[0].model_hash, &tasks[0].schema).await.unwrap();
    for i in 0..2 {
        let upload = upload_request(&tasks[i], &delta(i, 0, 64), weight(i));
        devices[i].upload(run, RoundIdx(0), &upload).await.unwrap();
    }
    let db = sqlx::PgPool::connect(url).await.unwrap();
    let epoch = || async {
        let (epoch,): (i64,) =
            sqlx::query_as("SELECT epoch FROM leadership").fetch_one(&db).await.unwrap();
        epoch
    };
    let leader_epoch = epoch().await;

    stall(&mut leader);
    let stalled = std::time::Instant::now();
    let http = http_client();
    wait_for("the standby to take over", takeover_bound(), || async {
        let runs = http.get(format!("{}/v1/admin/runs", standby.url)).bearer_auth(OPERATOR_TOKEN);
        Ok(runs.send().await.is_ok_and(|r| r.status().is_success()).then_some(()))
    })
    .await
    .unwrap_or_else(|e| {
        let log = std::fs::read_to_string(logs.path().join("b.log")).unwrap_or_default();
        panic!("{e}; standby log:\n{log}")
    });
    eprintln!("the standby took over {:?} after the leader stalled", stalled.elapsed());
    assert_eq!(epoch().await, leader_epoch + 1, "taking over moved the epoch on");

    // The old leader comes back (or not): it stops by itself, and writes nothing meanwhile.
    resume(&mut leader);
    let status = leader.exited_within(Duration::from_secs(20)).await.unwrap();
    assert!(!status.success(), "a deposed leader exits with an error: {status}");

    for d in &mut devices {
        let mut moved = starling_client::protocol::FleetClient::new(&standby.url);
        moved.set_credential(d.credential());
        *d = moved;
    }
    let admin = starling_client::protocol::AdminClient::new(&standby.url, OPERATOR_TOKEN);
    let round = admin.round(run, 0).await.unwrap();
    assert_eq!(
        (round.state.as_str(), round.n_reported.unwrap()),
        ("open", 2),
        "both acks survived"
    );
    let again = expect_tasks(&devices[2..]).await.unwrap();
    for (i, t) in (2..4).zip(&again) {
        let upload = upload_request(t, &delta(i, 0, 64), weight(i));
        devices[i].upload(run, RoundIdx(0), &upload).await.unwrap();
    }
    let hash = wait_model(&admin, run, 1).await.unwrap();
    let committed = model_values(&devices[0], &hash, &tasks[0].schema).await.unwrap();
    let contributions: Vec<_> = (0..4).map(|i| (delta(i, 0, 64), weight(i))).collect();
    assert_eq!(committed, fedavg_expected(&global, &contributions));
    assert_eq!(epoch().await, leader_epoch + 1, "only one takeover");
}

/// A leader paused with SIGSTOP (30 s used to leave the fleet with no leader at all).
#[sqlx::test(migrations = false)]
async fn a_standby_replaces_a_paused_leader_once_its_lease_lapses(
    _pool: sqlx::postgres::PgPoolOptions,
    opts: sqlx::postgres::PgConnectOptions,
) {
    let url = pg_url(&opts);
    let stop = |leader: &mut ChildCoordinator| leader.signal("STOP").unwrap();
    let resume = |leader: &mut ChildCoordinator| leader.signal("CONT").unwrap();
    a_standby_replaces_a_leader_that_stops_renewing(&url, &url, stop, resume).await;
}

/// A leader whose connections to Postgres are cut by a partition (no FIN, no RST): it stops
/// itself within its renewal timeout, and the standby terminates its lingering session once the
/// lease lapses.
#[sqlx::test(migrations = false)]
async fn a_standby_replaces_a_leader_cut_off_from_postgres(
    _pool: sqlx::postgres::PgPoolOptions,
    opts: sqlx::postgres::PgConnectOptions,
) {
    let url = pg_url(&opts);
    let mut through = reqwest::Url::parse(&url).unwrap();
    let upstream = format!("{}:{}", through.host_str().unwrap(), through.port().unwrap_or(5432));
    let upstream = tokio::net::lookup_host(upstream).await.unwrap().next().unwrap();
    let proxy = CuttableProxy::start(upstream).await;
    through.set_port(Some(proxy.addr.port())).unwrap();
    through.set_host(Some(&proxy.addr.ip().to_string())).unwrap();
    let cut = |_: &mut ChildCoordinator| proxy.cut();
    a_standby_replaces_a_leader_that_stops_renewing(&url, through.as_str(), cut, |_| {}).await;
}

/// A device's population is bound to its credential: the enrollment token names the
/// populations its devices may join, and a check-in to any other is refused (403
/// `population_not_allowed`) instead of joining that population's runs (any enrolled device,
/// a simulation's fleet or a rogue one, used to be able to name any population).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_checks_in_only_to_the_populations_its_token_names() {
    use starling_core::wire::CheckInResponse;
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let token = c.admin.enrollment_token_for(1, &["fleet-a"]).await.unwrap().token;
    let mut device = starling_client::protocol::FleetClient::new(&c.url);
    device.enroll(&token).await.unwrap();
    let mut elsewhere = one_round_plan(8, 1);
    elsewhere["population"] = "default".into();
    let default_run = RunId(c.admin.create_run(&elsewhere).await.unwrap().id);
    let mut ours = one_round_plan(8, 1);
    ours["population"] = "fleet-a".into();
    let run = RunId(c.admin.create_run(&ours).await.unwrap().id);
    wait_round_open(&c.admin, default_run, 0).await.unwrap();
    wait_round_open(&c.admin, run, 0).await.unwrap();
    for other in ["default", "fleet-b"] {
        let refused = device.check_in(other).await;
        assert_eq!(api_code(refused), Some(ErrorCode::PopulationNotAllowed), "{other}");
    }
    match device.check_in("fleet-a").await.unwrap() {
        CheckInResponse::Task(task) => assert_eq!(task.run_id, run),
        other => panic!("expected a task of run {run}, got {other:?}"),
    }
    assert_eq!(c.admin.round(default_run, 0).await.unwrap().n_selected.unwrap(), 0);
    // A second device on a one-use token is refused.
    let again = starling_client::protocol::FleetClient::new(&c.url).enroll(&token).await;
    assert_eq!(api_code(again), Some(ErrorCode::Unauthorized));
    c.running.shutdown().await.unwrap();
}

/// Admin bodies are bounded in size and time, and read only for the operator: a plan carrying
/// the initial parameters of a 600 000-parameter model (3.2 MB of base64; `runs create
/// --init-from` of any model past ~390 000 parameters) used to be refused with 413 by a 2 MB
/// limit, and now is sized from `--max-model-bytes`; an operator's stalled body is 408 at the
/// body deadline (admin bodies had no time limit); a large body without the operator's
/// credential is 401 before any of it is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_bodies_are_sized_from_the_model_limit_and_timed() {
    use base64::Engine as _;
    let (_dir, db) = sqlite_db();
    let c = start_in_process_configured(&db, &Default::default(), |config| {
        config.timeouts.body_grace = Duration::from_secs(1);
        config.timeouts.body_min_rate = 1 << 40;
    })
    .await
    .unwrap();
    const PARAMS: usize = 600_000;
    let values: Vec<f32> = (0..PARAMS).map(|i| (i % 97) as f32 / 97.0).collect();
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut plan = one_round_plan(PARAMS as u64, 1);
    plan["model"]["init"] = serde_json::json!({
        "kind": "parameters",
        "data_base64": base64::engine::general_purpose::STANDARD.encode(&bytes),
    });
    let run = RunId(c.admin.create_run(&plan).await.unwrap().id);
    let exported = c.admin.model_file(run, 0, "payload").await.unwrap();
    let payload: starling_core::tensor::TensorPayload =
        starling_core::codec::decode(&exported).unwrap();
    assert_eq!(payload.data, bytes, "the run starts from the parameters it was given");

    let addr = c.running.addr;
    let stalled = format!(
        "POST /v1/admin/enrollment-tokens HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {OPERATOR_TOKEN}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{"
    );
    let (status, took) = answer_within_20s(addr, stalled.to_owned()).await;
    assert!(status.starts_with("HTTP/1.1 408"), "{status}");
    assert!(took < Duration::from_secs(15), "answered after {took:?}");
    let stranger = "POST /v1/admin/runs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\nContent-Type: application/json\r\nContent-Length: 100000000\r\n\r\n{";
    let (status, took) = answer_within_20s(addr, stranger.to_owned()).await;
    assert!(status.starts_with("HTTP/1.1 401"), "{status}");
    assert!(took < Duration::from_secs(1), "answered after {took:?}");
    c.running.shutdown().await.unwrap();
}

/// The status line of the answer to the raw request `head` (waiting up to 20 s for it), and how
/// long it took.
async fn answer_within_20s(addr: std::net::SocketAddr, head: String) -> (String, Duration) {
    tokio::task::spawn_blocking(move || raw_answer(addr, head.as_bytes(), Duration::from_secs(20)))
        .await
        .unwrap()
}

/// Admin bodies had limits on size but not on what a field holds: a run named with 10 MB was
/// stored. A run's name over 256 bytes is now 422 naming `name`, and nothing is stored. A body
/// whose declared length is over its route's limit (a base model's import declaring 2^40
/// bytes once hung for 20 s and closed without an answer) is 413 at once, before any of it is
/// read. An enrolment's identity key of 33 bytes (an Ed25519 key is 32) is 400 naming
/// `identity_key`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_fields_and_declared_lengths_over_their_limits_are_refused_at_once() {
    use starling_client::protocol::{ClientError, FleetClient};
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let mut plan = one_round_plan(16, 1);
    plan["name"] = "n".repeat(1 << 20).into();
    match c.admin.create_run(&plan).await {
        Err(ClientError::Api { status, body }) => {
            assert_eq!(status.as_u16(), 422);
            assert!(body.message.contains("name") && body.message.contains("256"), "{body:?}");
            assert!(body.message.len() < 200, "the refusal does not echo the name");
        }
        other => panic!("a 1 MB name was not refused: {other:?}"),
    }
    assert!(c.admin.runs().await.unwrap().is_empty(), "nothing was stored");
    plan["name"] = "n".repeat(256).into();
    c.admin.create_run(&plan).await.unwrap();

    let addr = c.running.addr;
    for (path, declared) in [
        ("/v1/admin/base-models?name=big", 1u64 << 40),
        ("/v1/admin/enrollment-tokens", 100 << 20),
        ("/v1/admin/runs", 1 << 40),
        ("/v1/enroll", 1 << 30),
    ] {
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {OPERATOR_TOKEN}\r\nContent-Length: {declared}\r\n\r\n{{"
        );
        let (status, took) = answer_within_20s(addr, head).await;
        assert!(status.starts_with("HTTP/1.1 413"), "{path}: {status}");
        assert!(took < Duration::from_secs(2), "{path} answered after {took:?}");
    }

    let token = c.admin.enrollment_token(1).await.unwrap();
    #[derive(serde::Serialize)]
    struct Enroll<'a> {
        enrollment_token: &'a str,
        identity_key: Vec<u8>,
    }
    let device = FleetClient::new(&c.url);
    let long = Enroll { enrollment_token: &token, identity_key: vec![1; 33] };
    let body = starling_core::codec::to_vec(&long).unwrap();
    let (status, answer) =
        device.post_raw(starling_core::wire::path::ENROLL, body, "application/cbor").await.unwrap();
    let answer: starling_core::wire::ErrorBody = starling_core::codec::decode(&answer).unwrap();
    assert_eq!(status.as_u16(), 400, "{answer:?}");
    assert!(answer.message.contains("identity_key"), "{answer:?}");
    // The token was not spent on the refused enrolment.
    let mut device = FleetClient::new(&c.url);
    device.enroll(&token).await.unwrap();
    c.running.shutdown().await.unwrap();
}

/// A device could ask for a model in any encoding (`?compression=int8:1`, `int8:2`, …), each
/// one encoded afresh and cached, evicting what the fleet downloads (download p95 9 → 25 ms).
/// Now a model downloads only in f32 or its run's `model_download`; anything else is 422.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_downloads_only_in_its_runs_encoding() {
    use starling_core::compression::Compression;
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let devices = enroll(&c.url, &c.admin, 1).await.unwrap();
    let mut plan = one_round_plan(300, 1);
    plan["model_download"] = serde_json::json!({"kind": "int8", "block": 64});
    let run = RunId(c.admin.create_run(&plan).await.unwrap().id);
    wait_round_open(&c.admin, run, 0).await.unwrap();
    let task = expect_task(&devices[0]).await.unwrap();
    assert!(devices[0].model_in(&task.model_hash, task.model_download).await.is_ok());
    assert!(devices[0].model(&task.model_hash).await.is_ok());
    for other in
        [Compression::Int8 { block: 1 }, Compression::Int8 { block: 256 }, Compression::F16]
    {
        let refused = devices[0].model_in(&task.model_hash, other).await;
        assert_eq!(api_code(refused), Some(ErrorCode::InvalidField), "{other}");
    }
    c.running.shutdown().await.unwrap();
}

/// One upload at a time per device *and run*: a device selected in two runs (two populations
/// its token names) uploads to both at once, while a second upload to the same run is still
/// refused (409). It used to be one upload per device across all runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_uploads_to_two_runs_at_once_but_once_to_each() {
    use starling_core::wire::CheckInResponse;
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let token = c.admin.enrollment_token_for(1, &["p1", "p2"]).await.unwrap().token;
    let mut device = starling_client::protocol::FleetClient::new(&c.url);
    device.enroll(&token).await.unwrap();
    let mut runs = vec![];
    for population in ["p1", "p2"] {
        let mut plan = one_round_plan(64, 1);
        plan["population"] = population.into();
        let run = RunId(c.admin.create_run(&plan).await.unwrap().id);
        wait_round_open(&c.admin, run, 0).await.unwrap();
        match device.check_in(population).await.unwrap() {
            CheckInResponse::Task(task) => assert_eq!(task.run_id, run),
            other => panic!("expected a task, got {other:?}"),
        }
        runs.push(run);
    }
    let (addr, credential) = (c.running.addr, device.credential().unwrap().to_owned());
    let trickle = move |run: RunId, wait: Duration| {
        let head = format!(
            "POST /v1/runs/{run}/rounds/0/updates HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {credential}\r\nContent-Type: application/cbor\r\nContent-Length: 1000\r\n\r\n\x01"
        );
        tokio::task::spawn_blocking(move || raw_answer(addr, head.as_bytes(), wait).0)
    };
    let held = [trickle(runs[0], Duration::from_secs(3)), trickle(runs[1], Duration::from_secs(3))];
    tokio::time::sleep(Duration::from_millis(500)).await;
    let again = trickle(runs[0], Duration::from_secs(3)).await.unwrap();
    assert!(again.starts_with("HTTP/1.1 409"), "a second upload to one run: {again}");
    for (run, answer) in runs.iter().zip(held) {
        let answer = answer.await.unwrap();
        assert_eq!(answer, "", "run {run}: still waiting for its body, not refused");
    }
    c.running.shutdown().await.unwrap();
}

/// Enrollment tokens are listed for the operator with what limits them (the devices each may
/// still enroll, the populations it admits, its expiry), never with the token itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enrollment_tokens_are_listed_with_their_limits_and_never_shown_again() {
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let issued = c.admin.enrollment_token_for(3, &["fleet-a", "fleet-b"]).await.unwrap();
    starling_client::protocol::FleetClient::new(&c.url).enroll(&issued.token).await.unwrap();
    let listed = c.admin.enrollment_tokens().await.unwrap();
    assert_eq!(listed.len(), 1);
    let view = &listed[0];
    assert_eq!(view.uses_left, Some(2), "one of three uses spent");
    assert_eq!(
        view.populations.as_deref(),
        Some(&["fleet-a".to_owned(), "fleet-b".to_owned()][..])
    );
    assert_eq!((view.expires_at_ms, view.id.len()), (None, 12));
    let text = serde_json::to_string(&listed).unwrap();
    assert!(!text.contains(&issued.token), "the token itself is never shown again");
    c.running.shutdown().await.unwrap();
}

/// Three devices of a 64-value model, two of which commit a round: a round whose third device
/// never reports (refused) closes with the quorum at its short deadline.
fn three_devices_two_needed() -> PlanSpec {
    PlanSpec {
        cohort: 3,
        quorum: 2,
        selection_secs: 3.0,
        reporting_secs: 6.0,
        ..PlanSpec::all_of(3, 64, 2)
    }
}

/// In a plain FedAvg run of three devices, one device's finite but huge update once committed a
/// model of values near 2.7e38; every later round was refused, quarantine struck the honest
/// devices too, and the run failed `too_few_selected` forever while shown `running`. Now the
/// update is refused alone at upload (422, the plan's default `max_update_norm`), the honest
/// updates commit, and a run whose rounds keep failing stops with the reason in its view.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_device_cannot_end_a_run_and_a_run_that_cannot_progress_stops_saying_why() {
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let devices = enroll(&c.url, &c.admin, 3).await.unwrap();
    let spec = three_devices_two_needed();
    let run = RunId(c.admin.create_run(&spec.json()).await.unwrap().id);
    wait_round_open(&c.admin, run, 0).await.unwrap();
    let tasks = expect_tasks(&devices).await.unwrap();
    let huge = vec![1e30f32; 64];
    match devices[0].upload(run, tasks[0].round_idx, &upload_request(&tasks[0], &huge, 1)).await {
        Err(starling_client::protocol::ClientError::Api { status, body }) => {
            assert_eq!(status.as_u16(), 422);
            assert!(body.message.contains("max_update_norm"), "{body:?}");
        }
        other => panic!("a huge update was not refused: {other:?}"),
    }
    for i in 1..3 {
        let request = upload_request(&tasks[i], &delta(i, 0, 64), weight(i));
        devices[i].upload(run, tasks[i].round_idx, &request).await.unwrap();
    }
    let v1 = wait_model(&c.admin, run, 1).await.unwrap();
    let model = model_values(&devices[1], &v1, &spec.schema()).await.unwrap();
    assert!(model.iter().all(|v| v.abs() < 10.0), "the huge update reached the model");

    // A run no device takes part in: its rounds fail, and after two in a row it stops.
    let mut idle =
        PlanSpec { selection_secs: 0.1, reporting_secs: 0.2, ..PlanSpec::all_of(3, 8, 5) }.json();
    idle["population"] = "nobody".into();
    idle["max_failed_rounds"] = 2.into();
    let idle = RunId(c.admin.create_run(&idle).await.unwrap().id);
    let stopped = wait_for("the idle run to stop", Duration::from_secs(30), || async {
        let view = c.admin.run(idle).await?;
        Ok((view.status == "stopped").then_some(view))
    })
    .await
    .unwrap();
    let reason = stopped.stop_reason.unwrap_or_default();
    assert!(reason.contains("2 rounds in a row failed") && reason.contains("too_few"), "{reason}");
    assert_eq!(c.admin.rounds(idle).await.unwrap().len(), 2, "no round opened after the stop");
    c.running.shutdown().await.unwrap();
}

/// A lone leader under load once stopped itself mid-round: its lease renewal, an update of the
/// row every write of round state reads `FOR SHARE`, queued 1-4 s behind the upload writes and
/// timed out ("stopping so another coordinator can take over", with none to take over). Here a
/// transaction holds that row `FOR SHARE`, as a slow write does, and the lease's own row
/// locked, as a saturated store would delay the renewal itself, for longer than a renewal used
/// to be given; the leader keeps leading and serving, and writes again once they are free.
#[sqlx::test(migrations = false)]
async fn a_lone_leader_whose_renewal_is_delayed_by_load_keeps_leading(
    _pool: sqlx::postgres::PgPoolOptions,
    opts: sqlx::postgres::PgConnectOptions,
) {
    let url = pg_url(&opts);
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_coordinator_under_test"));
    let logs = tempfile::tempdir().unwrap();
    let log = logs.path().join("leader.log");
    let mut leader = ChildCoordinator::spawn(bin, &url, free_addr(), &log).await.unwrap();
    let admin = starling_client::protocol::AdminClient::new(&leader.url, OPERATOR_TOKEN);
    admin.create_run(&one_round_plan(16, 1)).await.unwrap();
    let db = sqlx::PgPool::connect(&url).await.unwrap();
    let mut busy = db.begin().await.unwrap();
    sqlx::query("SELECT epoch FROM leadership WHERE id = 1 FOR SHARE")
        .execute(&mut *busy)
        .await
        .unwrap();
    sqlx::query("SELECT lease_expires_at_ms FROM leadership_lease WHERE id = 1 FOR UPDATE")
        .execute(&mut *busy)
        .await
        .unwrap();
    let held = starling_coordinator::store::RENEW_EVERY
        + starling_coordinator::store::RENEW_TIMEOUT
        + Duration::from_secs(3);
    assert!(held < starling_coordinator::store::RENEW_GIVE_UP);
    let still = leader.exited_within(held).await;
    assert!(still.is_err(), "the leader stopped itself: {:?}", still.ok());
    busy.commit().await.unwrap();
    // Still the leader, and its writes go through again.
    let ready = http_client().get(format!("{}/readyz", leader.url)).send().await.unwrap();
    assert_eq!(ready.status().as_u16(), 200);
    admin.create_run(&one_round_plan(16, 1)).await.unwrap();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(text.contains("renewing the leadership lease is slow"), "the delay was seen: {text}");
    assert!(!text.contains("stopping so another coordinator can take over"), "{text}");
    leader.kill().unwrap();
}

/// Opens an HTTP/2 connection from `from` that never makes a request but sends a PING every
/// `every` (and reads the server's answers) until `until`; whether the server closed it.
async fn pinging_connection(
    from: std::net::IpAddr,
    to: std::net::SocketAddr,
    every: Duration,
    until: tokio::time::Instant,
) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(std::net::SocketAddr::new(from, 0)).unwrap();
    let Ok(mut stream) = socket.connect(to).await else { return true };
    let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";
    if stream.write_all(preface).await.is_err() {
        return true;
    }
    let ping = b"\x00\x00\x08\x06\x00\x00\x00\x00\x00starling";
    let mut buf = [0u8; 4096];
    while tokio::time::Instant::now() < until {
        if stream.write_all(ping).await.is_err() {
            return true;
        }
        let next = tokio::time::Instant::now() + every;
        while tokio::time::Instant::now() < next {
            match tokio::time::timeout_at(next, stream.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return true,
                Ok(Ok(_)) | Err(_) => {}
            }
        }
    }
    false
}

/// 400 connections, each sending an HTTP/2 PING every half second and never a request, once
/// held a coordinator capped at 400 connections: it evicted only connections silent for a
/// second, so honest clients were locked out (`/livez` 1 of 108). Now a connection counts as
/// busy only while it has a request in flight: at the cap the chattering ones make room, one
/// address may hold at most its own cap, and a connection with no request for the idle
/// timeout is closed however it chatters. Here 60 pinging connections from 127.0.0.2 against
/// a cap of 40 (20 per address): every honest request from 127.0.0.1 is answered, a device
/// round completes, and every pinging connection is closed within the idle timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_only_ping_lock_no_one_out() {
    let (dir, db) = sqlite_db();
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_coordinator_under_test"));
    let listen = free_addr();
    let args =
        ["--max-connections", "40", "--max-connections-per-ip", "20", "--idle-timeout-secs", "4"];
    let log = dir.path().join("coordinator.log");
    let coordinator =
        ChildCoordinator::spawn_with_nofile(bin, &db, listen, &log, 1024, &args).await.unwrap();
    let attacker: std::net::IpAddr = [127, 0, 0, 2].into();
    let until = tokio::time::Instant::now() + Duration::from_secs(12);
    let flood: Vec<_> = (0..60)
        .map(|_| {
            tokio::spawn(pinging_connection(attacker, listen, Duration::from_millis(500), until))
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(1_500)).await;

    let http = reqwest::Client::builder().timeout(Duration::from_secs(2)).build().unwrap();
    let mut answered = 0;
    for _ in 0..30 {
        // A new connection each time, as a fleet of devices would open.
        let fresh = reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .pool_max_idle_per_host(0)
            .build()
            .unwrap();
        if fresh
            .get(format!("{}/livez", coordinator.url))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            answered += 1;
        }
    }
    let log_text = || std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(answered, 30, "honest requests answered during the flood; log:\n{}", log_text());
    let ready = http.get(format!("{}/readyz", coordinator.url)).send().await.unwrap();
    assert!(ready.status().is_success());
    a_round_of_two_devices_commits(&coordinator.url).await;
    // Pinging for 12 s with an idle timeout of 4: the server closed every one of them.
    let mut kept = 0;
    for f in flood {
        if !f.await.unwrap() {
            kept += 1;
        }
    }
    assert_eq!(kept, 0, "pinging connections the server never closed");
}

/// A refused round used to strike every device in it: one device whose updates kept a run's
/// rounds refused took its honest partners into quarantine with it, and the run could never
/// commit again. A refusal is now traced to the updates that caused it (far larger than the
/// round's others) and strikes their devices alone: after three refused rounds the attacker is
/// quarantined, the honest devices are not, and the next round commits without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_round_strikes_only_the_device_whose_update_caused_it() {
    use starling_core::wire::CheckInResponse;
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let devices = enroll(&c.url, &c.admin, 3).await.unwrap();
    let spec = three_devices_two_needed();
    let mut plan = spec.json();
    // Let the huge update through the upload check: the commit's bound refuses the model.
    plan["max_update_norm"] = 1e12.into();
    let run = RunId(c.admin.create_run(&plan).await.unwrap().id);
    let huge = vec![1e9f32; 64];
    for round in 0..3 {
        wait_round_open(&c.admin, run, round).await.unwrap();
        let tasks = expect_tasks(&devices).await.unwrap();
        for (i, (d, t)) in devices.iter().zip(&tasks).enumerate() {
            let values = if i == 0 { huge.clone() } else { delta(i, round, 64) };
            d.upload(run, t.round_idx, &upload_request(t, &values, weight(i))).await.unwrap();
        }
        wait_for("the refusal", Duration::from_secs(30), || async {
            let r = c.admin.round(run, round).await?;
            Ok((r.state == "failed").then_some(()))
        })
        .await
        .unwrap();
        let outcome = c.admin.round(run, round).await.unwrap().outcome.unwrap();
        assert_eq!(outcome["outcome"], "aggregate_rejected", "{outcome}");
        let culprits = outcome["culprits"].as_array().map_or(0, Vec::len);
        assert_eq!(culprits, 1, "one device's update caused it: {outcome}");
    }
    // Round 3: the attacker is turned away; the honest two commit.
    wait_round_open(&c.admin, run, 3).await.unwrap();
    let turned_away = devices[0].check_in("default").await.unwrap();
    assert!(matches!(turned_away, CheckInResponse::ComeBackLater { .. }), "{turned_away:?}");
    let tasks = expect_tasks(&devices[1..]).await.unwrap();
    for (i, t) in (1..3).zip(&tasks) {
        let request = upload_request(t, &delta(i, 3, 64), weight(i));
        devices[i].upload(run, t.round_idx, &request).await.unwrap();
    }
    wait_model(&c.admin, run, 1).await.unwrap();
    c.running.shutdown().await.unwrap();
}

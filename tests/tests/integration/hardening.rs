//! Regression tests for the holes a hostile-input, load and security review found:
//! each failed before its fix.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use sqlx::Connection;
use starling_client::protocol::{FleetClient, TlsSettings};
use starling_core::wire::{CheckInResponse, ErrorCode, EvaluationReport};
use starling_core::{ModelVersion, RoundIdx, RunId};
use starling_tests::*;

/// Sends the head of a POST with `declared` bytes of body but only one byte of it, and returns
/// the status the coordinator answers while the body is still unsent (0 if it answered nothing
/// within `wait`), with how long that took.
fn trickled_upload(
    addr: SocketAddr,
    path: &str,
    credential: &str,
    declared: u64,
    wait: Duration,
) -> (u16, Duration) {
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {credential}\r\nContent-Type: application/cbor\r\nContent-Length: {declared}\r\n\r\n\x01"
    );
    let (line, took) = raw_answer(addr, head.as_bytes(), wait);
    let status = line.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, took)
}

/// Item 1: devices that were never selected opened uploads with a huge declared length and a
/// one-byte body, held all 16 upload permits until the body deadline, and the cohort's uploads
/// waited until the round failed. Now an over-long declaration is refused at once (413), an
/// unselected device is refused before its body is read (403), a device gets one upload at a
/// time (409), and the cohort's uploads go through meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unselected_devices_cannot_hold_the_upload_slots() {
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let devices = enroll(&c.url, &c.admin, 22).await.unwrap();
    // A cohort of three keeps the round open until every hostile upload is answered: were it
    // to close first, the late ones would rightly be 409 (round closed) and prove nothing.
    let run = RunId(c.admin.create_run(&one_round_plan(1000, 3)).await.unwrap().id);
    wait_round_open(&c.admin, run, 0).await.unwrap();
    let tasks = expect_tasks(&devices[..3]).await.unwrap();
    let path = format!("/v1/runs/{run}/rounds/0/updates");
    let addr = c.running.addr;
    // Well past the body deadline a held permit would last (30 s plus the limit at 16 KiB/s).
    let wait = Duration::from_secs(20);
    let attackers: Vec<_> = devices[3..]
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let (path, credential) = (path.clone(), d.credential().unwrap().to_owned());
            // Half declare far more than any upload may be, half a plausible length.
            let declared = if i % 2 == 0 { 1 << 40 } else { 4_000 };
            tokio::task::spawn_blocking(move || {
                (declared, trickled_upload(addr, &path, &credential, declared, wait))
            })
        })
        .collect();
    let upload = |i: usize| {
        let (d, t) = (&devices[i], &tasks[i]);
        let request = upload_request(t, &delta(i, 0, 1000), weight(i));
        async move { d.upload(run, t.round_idx, &request).await }
    };
    // Two of the cohort upload while the hostile connections are open.
    for i in 0..2 {
        upload(i).await.unwrap();
    }
    for attacker in attackers {
        let (declared, (status, took)) = attacker.await.unwrap();
        let expected = if declared > 1 << 30 { 413 } else { 403 };
        assert_eq!(status, expected, "declared {declared}: answered {status} after {took:?}");
        assert!(took < wait, "answered only when the body timed out");
    }
    upload(2).await.unwrap();
    wait_model(&c.admin, run, 1).await.unwrap();

    // One upload at a time per device: of two trickled at once, one is refused at once and
    // the other waits for its body.
    // The same three check in, so none of them can lose a selection draw.
    let run = RunId(c.admin.create_run(&one_round_plan(1000, 3)).await.unwrap().id);
    wait_round_open(&c.admin, run, 0).await.unwrap();
    expect_tasks(&devices[..3]).await.unwrap();
    let path = format!("/v1/runs/{run}/rounds/0/updates");
    let both: Vec<_> = (0..2)
        .map(|_| {
            let (path, credential) = (path.clone(), devices[0].credential().unwrap().to_owned());
            tokio::task::spawn_blocking(move || {
                trickled_upload(addr, &path, &credential, 4_000, Duration::from_secs(5)).0
            })
        })
        .collect();
    let mut answers = vec![];
    for one in both {
        answers.push(one.await.unwrap());
    }
    answers.sort();
    assert_eq!(answers, [0, 409], "0: still waiting for its body");
    c.running.shutdown().await.unwrap();
}

/// Items 3 and 6: a plan whose model is over the coordinator's limit is refused before anything
/// is allocated (a schema at the 2^31-element limit made it allocate 8 GiB and abort);
/// `If-None-Match` on a model that does not exist is 404, not 304; an upload to round −1 is 404,
/// not 409; `init` refuses unknown fields.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_and_protocol_answers() {
    let (_dir, db) = sqlite_db();
    let c = start_in_process_configured(&db, &TlsSettings::default(), |config| {
        config.limits.max_model_bytes = 4_000;
    })
    .await
    .unwrap();
    let huge = one_round_plan(1 << 31, 1);
    let err = c.admin.create_run(&huge).await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::InvalidPlan), "{err}");
    assert!(err.to_string().contains("--max-model-bytes"), "{err}");
    let err = c.admin.create_run(&one_round_plan(1001, 1)).await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::InvalidPlan), "{err}");
    let run = RunId(c.admin.create_run(&one_round_plan(1000, 1)).await.unwrap().id);

    let mut typo = one_round_plan(10, 1);
    typo["model"]["init"] = serde_json::json!({"kind": "zeros", "seed": 3});
    let err = c.admin.create_run(&typo).await.unwrap_err();
    assert!(err.to_string().contains("unknown field"), "{err}");

    let devices = enroll(&c.url, &c.admin, 1).await.unwrap();
    let http = http_client();
    let missing = "ab".repeat(32);
    let res = http
        .get(format!("{}/v1/models/{missing}", c.url))
        .bearer_auth(devices[0].credential().unwrap())
        .header("If-None-Match", format!("\"{missing}\""))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::NOT_FOUND);
    let task = expect_task(&devices[0]).await.unwrap();
    let res = http
        .get(format!("{}/v1/models/{}", c.url, task.model_hash))
        .bearer_auth(devices[0].credential().unwrap())
        .header("If-None-Match", format!("\"{}\"", task.model_hash))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::NOT_MODIFIED, "an existing model still revalidates");
    let res =
        devices[0].upload(run, RoundIdx(-1), &upload_request(&task, &delta(0, 0, 1000), 1)).await;
    assert_eq!(api_code(res), Some(ErrorCode::NotFound));
    c.running.shutdown().await.unwrap();
}

/// Items 4 and 5: evaluations were accepted from any enrolled device for any run, with any
/// values and 2^29 examples, and a plain run's example counts were uncapped, so one device
/// could dominate either mean. Now only devices selected for a round on the model version may
/// evaluate it, metrics are bounded, and both weights are capped at the plan's `max_examples`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_device_cannot_dominate_a_mean() {
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let devices = enroll(&c.url, &c.admin, 3).await.unwrap();
    let mut plan = one_round_plan(4, 2);
    plan["max_examples"] = 100.into();
    plan["model"]["init"] = serde_json::json!({"kind": "zeros"});
    let run = RunId(c.admin.create_run(&plan).await.unwrap().id);
    wait_round_open(&c.admin, run, 0).await.unwrap();
    let tasks = expect_tasks(&devices[..2]).await.unwrap();
    let report = |examples: u64, accuracy: f64| EvaluationReport {
        model_version: ModelVersion(0),
        example_count: examples,
        metrics: [("accuracy".to_owned(), accuracy)].into(),
    };
    // Device 2 was never selected: its evaluation is refused.
    let outsider = devices[2].evaluate(run, &report(10, 1.0)).await;
    assert_eq!(api_code(outsider), Some(ErrorCode::NotSelected));
    let absurd = devices[0].evaluate(run, &report(10, -1e300)).await;
    assert_eq!(api_code(absurd), Some(ErrorCode::InvalidField));
    devices[0].evaluate(run, &report(100, 0.2)).await.unwrap();
    devices[1].evaluate(run, &report(1 << 29, 1.0)).await.unwrap();
    let model0 = &c.admin.models(run).await.unwrap()[0];
    assert_eq!(model0.n_evaluations, 2);
    assert!((model0.evaluation["accuracy"] - 0.6).abs() < 1e-12, "{model0:?}");

    // +1 claimed by 2^29 examples, −1 by 100: with both capped at 100 the mean is 0.
    let up = upload_request(&tasks[0], &[1.0; 4], 1 << 29);
    let down = upload_request(&tasks[1], &[-1.0; 4], 100);
    devices[0].upload(run, RoundIdx(0), &up).await.unwrap();
    devices[1].upload(run, RoundIdx(0), &down).await.unwrap();
    let hash = wait_model(&c.admin, run, 1).await.unwrap();
    let model = model_values(&devices[0], &hash, &tasks[0].schema).await.unwrap();
    assert_eq!(model, vec![0.0; 4]);
    c.running.shutdown().await.unwrap();
}

/// Item 7: the listening socket asked for Rust's default backlog of 128, so an enrollment burst
/// of 2,000 devices overflowed it and clients waited out SYN retransmissions. The kernel now
/// queues up to 4096 (or net.core.somaxconn, if lower); `ss` shows a listener's queue size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_queues_an_enrollment_burst() {
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let port = c.running.addr.port();
    let out = match std::process::Command::new("ss")
        .args(["-ltnH", &format!("sport = :{port}")])
        .output()
    {
        Ok(out) if out.status.success() => out,
        other => {
            starling_core::skipped::skipped(
                "the_listener_queues_an_enrollment_burst",
                &format!("no ss: {other:?}"),
            );
            return;
        }
    };
    let text = String::from_utf8_lossy(&out.stdout);
    // State Recv-Q Send-Q ...: for a listener, Send-Q is the accept queue's size.
    let queue: u32 = text.split_whitespace().nth(2).and_then(|v| v.parse().ok()).unwrap();
    let somaxconn: u32 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(u32::MAX);
    assert_eq!(queue, starling_coordinator::DEFAULT_LISTEN_BACKLOG.min(somaxconn), "{text}");
    c.running.shutdown().await.unwrap();
}

/// Item 11: two coordinators share one Postgres. The standby listens (alive, ready for devices
/// as a replica, 503 for the admin API) instead of hanging in its start; when the leader is
/// SIGKILLed mid-round it
/// takes over within a bounded time, and the round commits with every update the dead leader
/// had acknowledged. The deposed leader's epoch is fenced off in the store.
#[sqlx::test(migrations = false)]
async fn a_standby_takes_over_and_loses_no_acknowledged_update(
    _pool: sqlx::postgres::PgPoolOptions,
    opts: sqlx::postgres::PgConnectOptions,
) {
    let url = pg_url(&opts);
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_coordinator_under_test"));
    let logs = tempfile::tempdir().unwrap();
    let mut leader =
        ChildCoordinator::spawn(bin, &url, free_addr(), &logs.path().join("a.log")).await.unwrap();
    let standby =
        ChildCoordinator::spawn_standby(bin, &url, free_addr(), &logs.path().join("b.log"))
            .await
            .unwrap();
    let http = http_client();
    let status = |base: &str, path: &str| {
        let request = http.get(format!("{base}{path}"));
        async move { request.send().await.unwrap().status() }
    };
    assert_eq!(status(&standby.url, "/livez").await, StatusCode::OK);
    assert_is_a_replica(&http, &standby.url).await;

    let admin = starling_client::protocol::AdminClient::new(&leader.url, OPERATOR_TOKEN);
    let mut devices = enroll(&leader.url, &admin, 4).await.unwrap();
    let run = RunId(admin.create_run(&one_round_plan(64, 4)).await.unwrap().id);
    wait_round_open(&admin, run, 0).await.unwrap();
    let tasks = expect_tasks(&devices).await.unwrap();
    let global = model_values(&devices[0], &tasks[0].model_hash, &tasks[0].schema).await.unwrap();
    for i in 0..2 {
        let ack = devices[i]
            .upload(run, RoundIdx(0), &upload_request(&tasks[i], &delta(i, 0, 64), weight(i)))
            .await;
        ack.unwrap();
    }
    let db = sqlx::PgPool::connect(&url).await.unwrap();
    let epoch = || async {
        let (epoch,): (i64,) =
            sqlx::query_as("SELECT epoch FROM leadership").fetch_one(&db).await.unwrap();
        epoch
    };
    let leader_epoch = epoch().await;
    leader.kill().unwrap();
    let killed = Instant::now();
    wait_for("the standby to take over", Duration::from_secs(30), || async {
        let runs = http.get(format!("{}/v1/admin/runs", standby.url)).bearer_auth(OPERATOR_TOKEN);
        Ok(runs.send().await.is_ok_and(|r| r.status() == StatusCode::OK).then_some(()))
    })
    .await
    .unwrap();
    eprintln!("the standby took over {:?} after the leader was killed", killed.elapsed());
    assert_eq!(epoch().await, leader_epoch + 1, "taking over moved the epoch on");

    // The fleet reaches the new leader (as a load balancer sends it to the ready one).
    for d in &mut devices {
        let mut moved = FleetClient::new(&standby.url);
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
        devices[i]
            .upload(run, RoundIdx(0), &upload_request(t, &delta(i, 0, 64), weight(i)))
            .await
            .unwrap();
    }
    let hash = wait_model(&admin, run, 1).await.unwrap();
    let committed = model_values(&devices[0], &hash, &tasks[0].schema).await.unwrap();
    let contributions: Vec<_> = (0..4).map(|i| (delta(i, 0, 64), weight(i))).collect();
    assert_eq!(committed, fedavg_expected(&global, &contributions));
}

/// A run whose store writes are stuck (here a row lock held by another session on
/// its open round, which its next selection must wait for) holds up only its own answers. The
/// driver hands each run's transitions to that run's writer instead of awaiting them, so a
/// device of another run is still selected at once; the stuck run's device gets its task when
/// the lock goes.
#[sqlx::test(migrations = false)]
async fn a_run_stuck_on_a_write_does_not_hold_up_another_run(
    _pool: sqlx::postgres::PgPoolOptions,
    opts: sqlx::postgres::PgConnectOptions,
) {
    let url = pg_url(&opts);
    let c = start_in_process(&url).await.unwrap();
    let devices = enroll_in(&c.url, &c.admin, 2, &["stuck", "free"]).await.unwrap();
    let mut runs = vec![];
    for population in ["stuck", "free"] {
        let mut plan = PlanSpec::all_of(1, 10, 1).json();
        plan["population"] = population.into();
        // Every device that checks in is selected (a random draw could pace it instead).
        plan["selection"] = "first_come".into();
        let run = RunId(c.admin.create_run(&plan).await.unwrap().id);
        wait_round_open(&c.admin, run, 0).await.unwrap();
        runs.push(run);
    }
    let mut blocker = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut blocker).await.unwrap();
    sqlx::query("SELECT * FROM rounds WHERE run_id = $1 FOR UPDATE")
        .bind(runs[0].0)
        .execute(&mut blocker)
        .await
        .unwrap();
    let stuck = {
        let device = devices[0].clone();
        tokio::spawn(async move { device.check_in("stuck").await })
    };
    // Give the stuck selection time to reach the store and wait on the lock.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let free = tokio::time::timeout(Duration::from_secs(5), devices[1].check_in("free")).await;
    let free = free.expect("the other run's check-in waited for the stuck run's write");
    assert!(matches!(free, Ok(CheckInResponse::Task(_))), "{free:?}");
    assert!(!stuck.is_finished(), "the stuck run's selection was answered before it was durable");
    sqlx::query("ROLLBACK").execute(&mut blocker).await.unwrap();
    let stuck = tokio::time::timeout(Duration::from_secs(10), stuck).await.unwrap().unwrap();
    assert!(matches!(stuck, Ok(CheckInResponse::Task(_))), "{stuck:?}");
    c.running.shutdown().await.unwrap();
}

/// Issue 51 item 2: hyper copied each response body into its connection's write buffer (the
/// coordinator's connection wrapper did not say it writes vectored) and kept the buffer at
/// that size while the connection stayed open, so every device connection that had downloaded
/// the model held a copy of it: the coordinator reached 957 MiB at 2 000 devices × 100k
/// parameters, 2.1 GiB at 5 000. Now a download only queues the model cache's shared bytes.
/// Forty open connections that each downloaded a 4 MB model added 160 MB before; now they add
/// no model-sized buffer each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_connections_do_not_each_keep_a_copy_of_the_model() {
    const PARAMS: usize = 1_000_000;
    const DEVICES: usize = 40;
    let (_dir, db) = sqlite_db();
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_coordinator_under_test"));
    let logs = tempfile::tempdir().unwrap();
    let c =
        ChildCoordinator::spawn(bin, &db, free_addr(), &logs.path().join("c.log")).await.unwrap();
    let admin = starling_client::protocol::AdminClient::new(&c.url, OPERATOR_TOKEN);
    let devices = enroll(&c.url, &admin, DEVICES).await.unwrap();
    let run =
        RunId(admin.create_run(&PlanSpec::all_of(DEVICES, PARAMS, 1).json()).await.unwrap().id);
    wait_round_open(&admin, run, 0).await.unwrap();
    let hash = expect_task(&devices[0]).await.unwrap().model_hash;
    // The first download fills the model cache; what comes after is per connection.
    devices[0].model(&hash).await.unwrap();
    let rss_mib = || process_memory_mib(c.pid(), "VmRSS").unwrap();
    let before = rss_mib();
    // Each device's client keeps its connection open (for 5 s idle) after its download.
    for device in &devices[1..] {
        device.model(&hash).await.unwrap();
    }
    let grown = rss_mib() - before;
    let model_mib = (PARAMS * 4) as f64 / (1024.0 * 1024.0);
    assert!(
        grown < 10.0 * model_mib,
        "{} open connections that downloaded a {model_mib:.1} MiB model grew the coordinator \
         by {grown:.1} MiB",
        DEVICES - 1
    );
}

/// An idle keep-alive connection holds no read or write buffer. hyper kept an 8 KiB read and
/// an 8 KiB write buffer for as long as a connection stayed open, so 10 000 open connections
/// took the coordinator to 227 MiB (issue 51's target: under 200); the patched hyper
/// (`vendor/README.md`) reads a waiting connection's next request through the stack and lets go
/// of its buffers between requests (98 MiB there). Here: 900 connections that each made one
/// request and stay open grow the coordinator by a few KiB each, not by its buffers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_keep_alive_connections_hold_no_buffers() {
    // The answer's head, then as many body bytes as its Content-Length says.
    let complete = |answer: &[u8]| {
        let text = String::from_utf8_lossy(answer);
        let (head, body) = text.split_once("\r\n\r\n")?;
        let length: usize = head.lines().find_map(|l| {
            l.to_ascii_lowercase().strip_prefix("content-length:")?.trim().parse().ok()
        })?;
        (body.len() >= length).then_some(head.starts_with("HTTP/1.1 200"))
    };
    let request = b"GET /healthz HTTP/1.1\r\nHost: starling\r\n\r\n";
    let per_connection = kib_per_open_connection(request, complete).await;
    assert!(
        per_connection < 8.0,
        "{OPEN_CONNECTIONS} idle keep-alive connections grew the coordinator by \
         {per_connection:.1} KiB each"
    );
}

/// A connection whose response is still being written holds no read buffer either: while
/// hyper writes a response it keeps reading the connection only to notice the peer closing,
/// and that read held an 8 KiB buffer for as long as the response lasted (10 000 devices
/// waiting on their downloads at once took the coordinator to 235 MiB). Here 900 operators each
/// hold the live event stream open, a response that never ends, and grow the coordinator by a
/// few KiB each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_with_a_response_under_way_hold_no_read_buffer() {
    let request = format!(
        "GET /v1/admin/events HTTP/1.1\r\nHost: starling\r\nAuthorization: Bearer \
         {OPERATOR_TOKEN}\r\nAccept: text/event-stream\r\n\r\n"
    );
    // The stream's head has arrived: its body is under way for as long as the connection lasts.
    let streaming = |answer: &[u8]| {
        let text = String::from_utf8_lossy(answer);
        let (head, _) = text.split_once("\r\n\r\n")?;
        Some(head.starts_with("HTTP/1.1 200") && head.contains("text/event-stream"))
    };
    let per_connection = kib_per_open_connection(request.as_bytes(), streaming).await;
    eprintln!("a connection with a response under way: {per_connection:.1} KiB");
    assert!(
        per_connection < 6.0,
        "{OPEN_CONNECTIONS} connections with a response under way grew the coordinator by \
         {per_connection:.1} KiB each"
    );
}

/// Fleet requests wait for a turn of their kind (512 decisions at once) before their handlers
/// run. Enrolment needs no credential, so were a decision's turn taken before its body is read,
/// 600 connections each trickling an enrolment body would hold every decision's turn until the
/// body deadline, and an enrolled device's check-in would wait out the 60 s queue deadline. The
/// body is read first: with the 600 still sending, the check-in is answered at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickled_enrolments_hold_no_check_in_turns() {
    use tokio::io::AsyncWriteExt;
    const TRICKLES: usize = 600;
    let c = ManyConnectionsCoordinator::spawn(&[]).await;
    let admin = starling_client::protocol::AdminClient::new(&c.child.url, OPERATOR_TOKEN);
    let device = enroll(&c.child.url, &admin, 1).await.unwrap().remove(0);
    let addr = c.addr;
    let head = "POST /v1/enroll HTTP/1.1\r\nHost: x\r\nContent-Type: application/cbor\r\n\
                Content-Length: 4000\r\n\r\n\x01";
    let mut trickles = Vec::with_capacity(TRICKLES);
    for _ in 0..TRICKLES {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream.write_all(head.as_bytes()).await.unwrap();
        trickles.push(stream);
    }
    // Every head and first byte is in the coordinator, and every body still unfinished.
    read_by_server(addr.port(), TRICKLES).await;
    let asked = Instant::now();
    let answer = tokio::time::timeout(Duration::from_secs(20), device.check_in("default"))
        .await
        .expect("a check-in answered within 20 s while 600 enrolments trickle")
        .unwrap();
    assert!(matches!(answer, CheckInResponse::ComeBackLater { .. }), "{answer:?}");
    assert!(asked.elapsed() < Duration::from_secs(10), "answered after {:?}", asked.elapsed());
    // The trickles were still open and unanswered: nothing to read on any of them.
    for stream in &trickles {
        let mut byte = [0u8; 1];
        assert!(
            matches!(stream.try_read(&mut byte), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
            "a trickled enrolment was answered before its body came"
        );
    }
}

/// A connection whose request head has come only in part holds the part, not a whole read
/// buffer. Every connection's first bytes pass through hyper-util's protocol sniffer, which
/// reads 24 of them and hands them back; hyper then read the rest of that head into an 8 KiB
/// buffer, held for as long as the request lasted: with 10 000 devices' first requests in
/// flight at once, 70 of the coordinator's 300 MiB. Here 900 connections each sent the first
/// 100 bytes of a head, which the coordinator has read, and grow it by a few KiB each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partly_arrived_request_holds_no_whole_read_buffer() {
    let head = format!(
        "POST /v1/check-in HTTP/1.1\r\nHost: starling\r\nContent-Type: application/cbor\r\n\
         Authorization: Bearer {}\r\n\r\n",
        "d".repeat(64)
    );
    let part = &head.as_bytes()[..100];
    // The heads stay unfinished while they are counted.
    let env = [("STARLING_HEADER_TIMEOUT_SECS", "120")];
    let per_connection = kib_per_connection(&env, |addr, n| partly_sent(addr, n, part)).await;
    eprintln!("a connection with a partly arrived head: {per_connection:.1} KiB");
    assert!(
        per_connection < 6.0,
        "{OPEN_CONNECTIONS} connections with a partly arrived head grew the coordinator by \
         {per_connection:.1} KiB each"
    );
}

/// `n` connections to `addr` that each sent `part` of a request, which the server has read,
/// and stay open.
async fn partly_sent(addr: SocketAddr, n: usize, part: &[u8]) -> Vec<tokio::net::TcpStream> {
    use tokio::io::AsyncWriteExt;
    let mut open = Vec::with_capacity(n);
    for _ in 0..n {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream.write_all(part).await.unwrap();
        open.push(stream);
    }
    read_by_server(addr.port(), n).await;
    open
}

/// Waits (10 s at most) until at least `n` established connections to the local `port` have
/// nothing left in their receive queues: the server has read what their peers sent.
async fn read_by_server(port: u16, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let local = format!(":{port:04X} ");
    loop {
        let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
        let (mut read, mut unread) = (0, 0);
        for line in table.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // local address, remote address, state (01: established), tx_queue:rx_queue
            let (Some(local_address), Some("01"), Some(queues)) =
                (fields.get(1), fields.get(3).copied(), fields.get(4))
            else {
                continue;
            };
            if !format!("{local_address} ").ends_with(&local) {
                continue;
            }
            if queues.ends_with(":00000000") { read += 1 } else { unread += 1 }
        }
        if read >= n && unread == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "after 10 s the coordinator had read {read} of {n} connections' bytes ({unread} unread)"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Connections the connection-memory tests open and keep open.
const OPEN_CONNECTIONS: usize = 900;

/// How much a fresh coordinator (on SQLite) grows, in KiB, for each of [`OPEN_CONNECTIONS`]
/// connections that sent `request`, read until `answered`, and stay open.
async fn kib_per_open_connection(
    request: &[u8],
    answered: impl Fn(&[u8]) -> Option<bool> + Copy,
) -> f64 {
    kib_per_connection(&[], |addr, n| open_connections(addr, n, request, answered)).await
}

/// How much a fresh coordinator (on SQLite, with `env` besides the operator token and no
/// per-address cap) grows, in KiB, for each of [`OPEN_CONNECTIONS`] connections that `open`
/// opens and keeps open; measured after 50 such connections warmed its allocator and tasks up.
async fn kib_per_connection<F, Opened>(env: &[(&str, &str)], open: F) -> f64
where
    F: Fn(SocketAddr, usize) -> Opened,
    Opened: std::future::Future<Output = Vec<tokio::net::TcpStream>>,
{
    let c = ManyConnectionsCoordinator::spawn(env).await;
    let rss_kib = || process_memory_mib(c.child.pid(), "VmRSS").unwrap() * 1024.0;
    let _warm = open(c.addr, 50).await;
    let before = rss_kib();
    let _open = open(c.addr, OPEN_CONNECTIONS).await;
    (rss_kib() - before) / OPEN_CONNECTIONS as f64
}

/// A coordinator process of its own (so the test's connections and its are counted apart) on
/// a fresh SQLite store, with `env` besides the operator token and no per-address cap (every
/// test connection comes from one address).
struct ManyConnectionsCoordinator {
    child: ChildCoordinator,
    addr: SocketAddr,
    _db: tempfile::TempDir,
    _logs: tempfile::TempDir,
}

impl ManyConnectionsCoordinator {
    async fn spawn(env: &[(&str, &str)]) -> Self {
        let (db_dir, db) = sqlite_db();
        let bin = std::path::Path::new(env!("CARGO_BIN_EXE_coordinator_under_test"));
        let logs = tempfile::tempdir().unwrap();
        let mut all_env = vec![
            ("STARLING_OPERATOR_TOKEN", OPERATOR_TOKEN),
            ("STARLING_MAX_CONNECTIONS_PER_IP", "0"),
        ];
        all_env.extend_from_slice(env);
        let log = logs.path().join("c.log");
        let child =
            ChildCoordinator::spawn_with(bin, &db, free_addr(), &log, &all_env).await.unwrap();
        let addr = child.url.strip_prefix("http://").expect("plain HTTP").parse().unwrap();
        ManyConnectionsCoordinator { child, addr, _db: db_dir, _logs: logs }
    }
}

/// `n` connections to `addr` that each sent `request` and read until `answered` says what came
/// back is enough (`Some(true)`: as expected), and stay open.
async fn open_connections(
    addr: SocketAddr,
    n: usize,
    request: &[u8],
    answered: impl Fn(&[u8]) -> Option<bool>,
) -> Vec<tokio::net::TcpStream> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut open = Vec::with_capacity(n);
    for _ in 0..n {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream.write_all(request).await.unwrap();
        let mut answer = Vec::new();
        let mut chunk = [0u8; 1024];
        let ok = loop {
            let read = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut chunk))
                .await
                .expect("the answer within 10 s")
                .unwrap();
            assert!(read > 0, "the coordinator closed a keep-alive connection");
            answer.extend_from_slice(&chunk[..read]);
            if let Some(ok) = answered(&answer) {
                break ok;
            }
        };
        assert!(ok, "{}", String::from_utf8_lossy(&answer));
        open.push(stream);
    }
    open
}

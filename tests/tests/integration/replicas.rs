//! Fleet traffic on every replica: coordinators that do not lead serve devices' check-ins,
//! downloads and uploads, relaying round decisions to the leader through Postgres; a fleet
//! behind an address list of replicas rides through the leader's death without losing an
//! acknowledged update.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use starling_client::protocol::{FleetClient, retrying};
use starling_core::wire::{CheckInResponse, ErrorCode, TaskAssignment};
use starling_core::{RoundIdx, RunId};
use starling_tests::*;

fn coordinator_bin() -> &'static std::path::Path {
    std::path::Path::new(env!("CARGO_BIN_EXE_coordinator_under_test"))
}

/// A replica serves devices from enrollment to acknowledgement: check-ins get the leader's
/// selection (a task for two of three devices, "come back" for the third), the model comes
/// from the store, uploads are acknowledged once the leader's round holds them, and the
/// leader's refusals come back as they are (an unselected device's 403, a retried upload's
/// duplicate). The round commits the exact FedAvg of what the replica acknowledged. The admin
/// API is the leader's: a replica answers it 503, saying why.
#[sqlx::test(migrations = false)]
async fn a_replica_serves_devices_and_the_leader_folds_what_it_relays(
    _pool: sqlx::postgres::PgPoolOptions,
    opts: sqlx::postgres::PgConnectOptions,
) {
    let url = pg_url(&opts);
    let logs = tempfile::tempdir().unwrap();
    let leader =
        ChildCoordinator::spawn(coordinator_bin(), &url, free_addr(), &logs.path().join("a.log"))
            .await
            .unwrap();
    let replica = ChildCoordinator::spawn_standby(
        coordinator_bin(),
        &url,
        free_addr(),
        &logs.path().join("b.log"),
    )
    .await
    .unwrap();
    assert_is_a_replica(&http_client(), &replica.url).await;

    let admin = starling_client::protocol::AdminClient::new(&leader.url, OPERATOR_TOKEN);
    let devices = enroll(&replica.url, &admin, 3).await.unwrap();
    let run = RunId(admin.create_run(&one_round_plan(64, 2)).await.unwrap().id);
    wait_round_open(&admin, run, 0).await.unwrap();
    let mut selected = vec![];
    let mut told_to_come_back = vec![];
    for (i, d) in devices.iter().enumerate() {
        match d.check_in("default").await.unwrap() {
            CheckInResponse::Task(task) => selected.push((i, task)),
            CheckInResponse::ComeBackLater { .. } => told_to_come_back.push(i),
        }
    }
    assert_eq!((selected.len(), told_to_come_back.len()), (2, 1), "the leader selects two");
    let (first, task) = &selected[0];
    let global = model_values(&devices[*first], &task.model_hash, &task.schema).await.unwrap();

    let outsider = &devices[told_to_come_back[0]];
    let unasked = upload_request(task, &delta(9, 0, 64), 10);
    let refused = outsider.upload(run, RoundIdx(0), &unasked).await;
    assert_eq!(api_code(refused), Some(ErrorCode::NotSelected));

    let mut contributions = vec![];
    for (i, task) in &selected {
        let upload = upload_request(task, &delta(*i, 0, 64), weight(*i));
        let ack = devices[*i].upload(run, RoundIdx(0), &upload).await.unwrap();
        assert_eq!((ack.run_id, ack.round_idx), (run, RoundIdx(0)));
        contributions.push((delta(*i, 0, 64), weight(*i)));
    }
    let hash = wait_model(&admin, run, 1).await.unwrap();
    let committed = model_values(&devices[*first], &hash, &task.schema).await.unwrap();
    assert_eq!(committed, fedavg_expected(&global, &contributions));
    let round = admin.round(run, 0).await.unwrap();
    assert_eq!(round.n_reported, Some(2));

    // The same upload again, straight to the leader: it was counted once.
    let again = FleetClient::with_credential(&leader.url, devices[*first].credential().unwrap());
    let upload = upload_request(task, &delta(*first, 0, 64), weight(*first));
    assert_eq!(
        api_code(again.upload(run, RoundIdx(0), &upload).await),
        Some(ErrorCode::DuplicateUpload)
    );
}

/// A TCP front for a list of coordinators, as a DNS name with several addresses or a load
/// balancer is: each new connection goes to the next address in turn, skipping one that
/// refuses. The list can be changed (a replaced coordinator's address swapped in).
struct AddressList {
    addr: SocketAddr,
    backends: Arc<Mutex<Vec<SocketAddr>>>,
    /// Connections each backend took, by address.
    served: Arc<Mutex<std::collections::HashMap<SocketAddr, usize>>>,
}

impl AddressList {
    async fn start(backends: Vec<SocketAddr>) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let backends = Arc::new(Mutex::new(backends));
        let served = Arc::new(Mutex::new(std::collections::HashMap::new()));
        let (list, counts) = (backends.clone(), served.clone());
        tokio::spawn(async move {
            let mut next = 0usize;
            while let Ok((mut client, _)) = listener.accept().await {
                let candidates = list.lock().unwrap().clone();
                let (list_len, start) = (candidates.len(), next);
                next += 1;
                let counts = counts.clone();
                tokio::spawn(async move {
                    for k in 0..list_len {
                        let backend = candidates[(start + k) % list_len];
                        let Ok(mut server) = tokio::net::TcpStream::connect(backend).await else {
                            continue;
                        };
                        *counts.lock().unwrap().entry(backend).or_insert(0) += 1;
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                        return;
                    }
                });
            }
        });
        AddressList { addr, backends, served }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn replace(&self, gone: SocketAddr, new: SocketAddr) {
        for b in self.backends.lock().unwrap().iter_mut() {
            if *b == gone {
                *b = new;
            }
        }
    }

    fn served(&self, backend: SocketAddr) -> usize {
        self.served.lock().unwrap().get(&backend).copied().unwrap_or(0)
    }
}

fn socket(url: &str) -> SocketAddr {
    url.trim_start_matches("http://").parse().unwrap()
}

/// How often a device here asks again after a transient failure (transport error, 503, 429),
/// backing off from 200 ms to 10 s (`protocol::retrying`): about 40 s, beyond a takeover.
const TRIES: u32 = 10;

/// One device's part in round `round`: check in until the round's task comes, download the
/// model, upload its delta. `Ok` only when the update is acknowledged — a 200, or a retry's
/// `duplicate_upload` after an answer lost with a dead coordinator (the update was counted).
async fn take_part(device: &FleetClient, i: usize, run: RunId, round: i64) -> TaskAssignment {
    let deadline = Instant::now() + Duration::from_secs(90);
    let task = loop {
        let answer = retrying(TRIES, || device.check_in("default")).await.unwrap();
        match answer {
            CheckInResponse::Task(t) if t.round_idx == RoundIdx(round) => break t,
            other => {
                assert!(
                    Instant::now() < deadline,
                    "device {i}: no task for round {round}: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    retrying(TRIES, || device.model(&task.model_hash)).await.unwrap();
    let upload = upload_request(&task, &delta(i, round, 64), weight(i));
    let ack = retrying(TRIES, || device.upload(run, RoundIdx(round), &upload)).await;
    match ack {
        Ok(_) => {}
        Err(e) if e.code() == Some(ErrorCode::DuplicateUpload) => {}
        Err(e) => panic!("device {i}, round {round}: upload not acknowledged: {e}"),
    }
    task
}

/// Two coordinators behind one address list, a fleet of four devices that all take part in
/// each of three rounds. In round 1, once two devices are acknowledged, the leader is killed
/// (SIGKILL); the other two devices reach only the replica, which takes over while their
/// requests wait (retrying what fails, as the SDK does), and round 1 completes. A new
/// coordinator then replaces the dead one in the address list and serves round 2 as the new
/// leader's replica. Every round commits the exact FedAvg of its four deltas (so every
/// acknowledged update was folded, none twice), and both the old replica and the newcomer
/// served devices.
#[sqlx::test(migrations = false)]
async fn a_fleet_behind_two_replicas_completes_rounds_while_the_leader_is_killed_and_replaced(
    _pool: sqlx::postgres::PgPoolOptions,
    opts: sqlx::postgres::PgConnectOptions,
) {
    let url = pg_url(&opts);
    let logs = tempfile::tempdir().unwrap();
    let log = |name: &str| logs.path().join(name);
    let mut a =
        ChildCoordinator::spawn(coordinator_bin(), &url, free_addr(), &log("a.log")).await.unwrap();
    let b = ChildCoordinator::spawn_standby(coordinator_bin(), &url, free_addr(), &log("b.log"))
        .await
        .unwrap();
    let front = AddressList::start(vec![socket(&a.url), socket(&b.url)]).await;
    let admin = starling_client::protocol::AdminClient::new(&a.url, OPERATOR_TOKEN);
    let devices = enroll(&front.url(), &admin, 4).await.unwrap();
    let plan = PlanSpec::all_of(4, 64, 3);
    let run = RunId(admin.create_run(&plan.json()).await.unwrap().id);
    wait_round_open(&admin, run, 0).await.unwrap();

    let round = |ids: Vec<usize>, round: i64| {
        let devices = &devices;
        futures_util::future::join_all(
            ids.into_iter()
                .map(move |i| async move { take_part(&devices[i], i, run, round).await }),
        )
    };
    let tasks = round(vec![0, 1, 2, 3], 0).await;
    let schema = plan.schema();
    let global = model_values(&devices[0], &tasks[0].model_hash, &schema).await.unwrap();
    wait_model(&admin, run, 1).await.unwrap();
    round(vec![0, 1], 1).await;

    // The leader dies mid-round: the other two devices reach only the replica, which relays
    // to no one until it takes over (its relayed requests wait, or are cut by its switch to
    // leading, and retried).
    a.kill().unwrap();
    let killed = Instant::now();
    round(vec![2, 3], 1).await;
    eprintln!("round 1 finished {:?} after the leader was killed", killed.elapsed());
    // A new coordinator replaces the dead one in the address list: a replica of the new leader.
    let c = ChildCoordinator::spawn_standby(coordinator_bin(), &url, free_addr(), &log("c.log"))
        .await
        .unwrap();
    front.replace(socket(&a.url), socket(&c.url));
    round(vec![0, 1, 2, 3], 2).await;

    // The replica took over; the newcomer serves as its replica.
    let leader = starling_client::protocol::AdminClient::new(&b.url, OPERATOR_TOKEN);
    let newcomer = starling_client::protocol::AdminClient::new(&c.url, OPERATOR_TOKEN);
    assert_eq!(api_code(newcomer.runs().await), Some(ErrorCode::Unavailable), "c is a replica");
    let mut expected = global;
    for version in 1..=3 {
        let hash = wait_model(&leader, run, version).await.unwrap();
        let committed = model_values(&devices[0], &hash, &schema).await.unwrap();
        let contributions: Vec<_> =
            (0..4).map(|i| (delta(i, version - 1, 64), weight(i))).collect();
        expected = fedavg_expected(&expected, &contributions);
        assert_eq!(committed, expected, "model version {version}");
        let stored = leader.round(run, version - 1).await.unwrap();
        assert_eq!(stored.n_reported, Some(4), "round {}", version - 1);
    }
    for (name, url) in [("the first replica", &b.url), ("the newcomer", &c.url)] {
        assert!(front.served(socket(url)) > 0, "{name} served no device");
    }
}

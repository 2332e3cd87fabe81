//! One conformance suite, run against every store backend: each behaviour is a test of its own
//! on Postgres (a fresh database per test through `#[sqlx::test]`) and on SQLite (a fresh file
//! per test), in the manner of quickwit's `metastore_test_suite!`.

use std::collections::BTreeMap;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use starling_coordinator::store::{
    GroupMember, LEASE, ModelBytes, NewRun, PendingModel, RENEW_EVERY, RENEW_TIMEOUT, RoundCommit,
    RoundDeviceRow, STANDBY_POLL, SqlStore, StoreError, StoredContribution, Transition, redact,
    with_database,
};
use starling_core::codec;
use starling_core::fedavg::{FoldedGroup, PartialSums, PooledEvaluation};
use starling_core::round::participation_rule::History;
use starling_core::round::quarantine::Strikes;
use starling_core::round::{CarriedTask, RoundClosing, RoundOpened, RoundOutcome, StoredPartial};
use starling_core::tier::PartialReport;
use starling_core::{AggregatorId, DeviceId, ModelVersion, RoundIdx, RunId};

/// Runs each named behaviour on both backends: `<behaviour>::postgres` and
/// `<behaviour>::sqlite`.
macro_rules! conformance {
    ($($behaviour:ident),* $(,)?) => {$(
        mod $behaviour {
            #[sqlx::test(migrations = false)]
            async fn postgres(
                _pool: sqlx::postgres::PgPoolOptions,
                opts: sqlx::postgres::PgConnectOptions,
            ) {
                let store = super::SqlStore::connect(&super::pg_url(&opts), true).await.unwrap();
                super::$behaviour(store).await;
            }

            #[tokio::test]
            async fn sqlite() {
                let dir = tempfile::tempdir().unwrap();
                let url = format!("sqlite://{}", dir.path().join("store.db").display());
                super::$behaviour(super::SqlStore::connect(&url, true).await.unwrap()).await;
                // Migrating an up-to-date store again is a no-op, not an error.
                super::SqlStore::connect(&url, true).await.unwrap();
            }
        }
    )*};
}

conformance!(
    enrollment_spends_tokens_and_revocation_is_immediate,
    a_run_starts_with_its_model_version_zero,
    transitions_are_idempotent_and_the_open_round_comes_back,
    updates_are_durable_once_and_replay_in_slot_order,
    a_group_of_updates_is_durable_whole_and_replays_at_its_last_slot,
    partials_are_durable_once_and_count_their_devices,
    secure_records_come_back_in_order_and_go_with_the_round,
    a_commit_advances_the_run_and_releases_payloads,
    a_failed_round_records_its_outcome_once,
    an_evaluation_round_records_its_reports_and_keeps_the_model,
    evaluations_are_one_per_device_and_version,
    stopping_a_run_fails_its_open_round,
    update_tiles_are_slices_of_every_update_in_slot_order,
    carried_tasks_are_the_selected_devices_not_heard_from_since,
    a_durable_update_is_found_for_its_task_after_its_round_closed,
    payloads_are_released_only_once_their_round_closed,
    batches_written_together_keep_their_order_and_their_times,
    a_model_committed_by_its_hash_keeps_its_round_payloads_until_written,
    models_between_checkpoints_are_given_up_once_a_later_one_is_written,
    a_model_read_while_its_bytes_are_written_is_pending_or_there,
    devices_may_join_only_the_populations_their_token_names,
    a_device_keeps_the_identity_key_it_enrolled_with,
    a_population_a_run_claims_is_busy_for_every_other_run_while_it_runs,
    quarantine_strikes_count_refused_rounds_by_updates_and_partials,
    participation_history_counts_every_selection_with_its_latest_model,
    an_imported_model_is_kept_once_by_its_hash,
    an_imported_tokenizer_is_kept_once_by_its_hash,
    relayed_requests_are_taken_once_in_order_and_answered_to_their_replica,
    the_latest_accuracy_reports_are_of_the_newest_version_two_devices_scored,
);

/// The Postgres URL of the database `#[sqlx::test]` created for this test.
fn pg_url(opts: &PgConnectOptions) -> String {
    let base = std::env::var("DATABASE_URL").expect("DATABASE_URL is set for Postgres tests");
    with_database(&base, opts.get_database().expect("sqlx::test names a database"))
}

#[test]
fn database_name_is_replaced_and_password_redacted() {
    assert_eq!(with_database("postgres://u:p@h:5/postgres", "t_1"), "postgres://u:p@h:5/t_1");
    assert_eq!(
        with_database("postgres://u@h/db?sslmode=disable", "x"),
        "postgres://u@h/x?sslmode=disable"
    );
    assert_eq!(with_database("postgres://h", "x"), "postgres://h/x");
    assert_eq!(redact("postgres://u:secret@h/db"), "postgres://u:***@h/db");
}

#[tokio::test]
async fn unsupported_url_is_named() {
    let err = SqlStore::connect("mysql://u:secret@h/db", true).await.unwrap_err();
    assert!(matches!(err, StoreError::UnsupportedUrl(_)));
    assert!(!err.to_string().contains("secret"), "password leaked: {err}");
}

/// A coordinator whose leadership passed to another could keep writing round state
/// (for the seconds until it noticed). Taking the lock now moves the leadership epoch on, and
/// every write of round state of the deposed leader fails without writing anything. (Postgres
/// only: SQLite is one process per file.)
#[sqlx::test(migrations = false)]
async fn postgres_fences_a_deposed_leader(_pool: PgPoolOptions, opts: PgConnectOptions) {
    let url = pg_url(&opts);
    let deposed = SqlStore::connect(&url, true).await.unwrap();
    let lead = deposed.acquire_leadership().await.unwrap();
    assert_eq!(lead.epoch(), 1);
    let run = deposed.create_run(new_run(), 1).await.unwrap();
    let successor = SqlStore::connect(&url, false).await.unwrap();
    assert!(successor.try_acquire_leadership().await.unwrap().is_none(), "the lock is held");
    // The deposed leader's lock connection ends (here it is dropped; in production it died).
    drop(lead);
    let taken = successor.try_acquire_leadership().await.unwrap().expect("the lock is free");
    assert_eq!(taken.epoch(), 2);
    let open = [Transition::OpenRound(opened(0, 0))];
    let err = deposed.apply_transitions(run, &open, 2).await.unwrap_err();
    assert!(matches!(err, StoreError::Fenced { ours: 1, current: 2 }), "{err}");
    assert!(deposed.open_round(run).await.unwrap().is_none(), "nothing was written");
    assert!(matches!(deposed.create_run(new_run(), 2).await, Err(StoreError::Fenced { .. })));
    successor.apply_transitions(run, &open, 3).await.unwrap();
    let update =
        deposed.insert_update(run, RoundIdx(0), DeviceId(1), 0, 0, 1, "{}", &[0; 4], 3).await;
    assert!(matches!(update, Err(StoreError::Fenced { .. })), "{update:?}");
    assert_eq!(successor.running_runs().await.unwrap().len(), 1);
}

/// A leader that stopped renewing its lease (here: the row says it lapsed, as it would after a
/// SIGSTOP or a cut-off network) no longer blocks failover: a standby terminates the session
/// holding the lock, takes it, and moves the epoch on; the old leader sees its lock lost. A
/// renewed lease is never broken. (Postgres only.)
#[sqlx::test(migrations = false)]
async fn postgres_a_lapsed_leader_lease_is_broken_and_a_live_one_is_not(
    _pool: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let url = pg_url(&opts);
    let leader = SqlStore::connect(&url, true).await.unwrap();
    let mut lead = leader.acquire_leadership().await.unwrap();
    let standby = SqlStore::connect(&url, false).await.unwrap();
    assert!(!standby.break_lapsed_lease().await.unwrap(), "a fresh lease is not broken");
    assert!(standby.try_acquire_leadership().await.unwrap().is_none(), "the lock is held");
    let sql = sqlx::PgPool::connect(&url).await.unwrap();
    sqlx::query("UPDATE leadership_lease SET lease_expires_at_ms = 0").execute(&sql).await.unwrap();
    assert!(standby.break_lapsed_lease().await.unwrap(), "a lapsed lease is broken");
    let lost = tokio::time::timeout(RENEW_EVERY + RENEW_TIMEOUT * 2, lead.lost()).await;
    assert!(lost.is_ok(), "the old leader noticed its session was terminated");
    let taken = tokio::time::timeout(STANDBY_POLL * 10, standby.wait_for_leadership())
        .await
        .expect("the standby takes the released lock");
    assert_eq!(taken.epoch(), 2);
    let (pid, lease): (i64, i64) = sqlx::query_as(
        "SELECT backend_pid, lease_expires_at_ms - (extract(epoch from clock_timestamp()) * 1000)::bigint FROM leadership_lease",
    )
    .fetch_one(&sql)
    .await
    .unwrap();
    assert!(pid > 0 && lease > 0 && lease <= LEASE.as_millis() as i64, "{pid} {lease}");
    assert!(matches!(leader.create_run(new_run(), 1).await, Err(StoreError::Fenced { .. })));
}

fn new_run() -> NewRun<'static> {
    NewRun {
        name: Some("r"),
        population: "p",
        plan_json: "{}",
        initial_model: b"m0",
        initial_model_hash: "h0",
        exclusive_population: false,
    }
}

fn opened(round: i64, version: i64) -> RoundOpened {
    RoundOpened {
        round_idx: RoundIdx(round),
        model_version: ModelVersion(version),
        opened_at: 1_000,
        selection_deadline: 2_000,
        reporting_deadline: 5_000,
    }
}

fn closing(round: i64, version: i64, outcome: RoundOutcome) -> RoundClosing {
    RoundClosing {
        round_idx: RoundIdx(round),
        model_version: ModelVersion(version),
        outcome,
        n_selected: 3,
        n_reported: 2,
        n_dropped: 1,
        closed_at: 4_000,
    }
}

fn secagg(seq: i64, bytes: &[u8]) -> Transition {
    Transition::SecAggRecord { round_idx: RoundIdx(0), seq, record: bytes.to_vec() }
}

/// Three enrolled devices.
async fn devices(store: &SqlStore) -> [DeviceId; 3] {
    store.create_enrollment_token("many", 0, None, None, None).await.unwrap();
    let mut out = [DeviceId(0); 3];
    for (i, d) in out.iter_mut().enumerate() {
        *d = store.enroll_device("many", &format!("credential-{i}"), None, 5).await.unwrap();
    }
    out
}

/// A run whose round 0 is open with the three devices selected, the third through aggregator
/// 7.
async fn run_with_open_round(store: &SqlStore) -> (RunId, [DeviceId; 3]) {
    let [d1, d2, d3] = devices(store).await;
    let run = store.create_run(new_run(), 100).await.unwrap();
    let batch = [
        Transition::OpenRound(opened(0, 0)),
        Transition::Select { round_idx: RoundIdx(0), device: d1, aggregator: None },
        Transition::Select { round_idx: RoundIdx(0), device: d2, aggregator: None },
        Transition::Select {
            round_idx: RoundIdx(0),
            device: d3,
            aggregator: Some(AggregatorId(7)),
        },
    ];
    store.apply_transitions(run, &batch, 1_000).await.unwrap();
    (run, [d1, d2, d3])
}

fn partial(device: DeviceId) -> PartialReport {
    PartialReport {
        model_version: ModelVersion(0),
        schema_id: starling_core::tensor::SchemaId([3; 32]),
        aggregators: vec![AggregatorId(7)],
        devices: vec![device],
        total_weight: 12,
        sum_hi: vec![1; 16],
        sum_lo: vec![0; 16],
        metrics: BTreeMap::from([("loss".to_owned(), (6.0, 12))]),
    }
}

/// Commits round 0 of `run` as model version 1 (hash "h1", bytes "m1"), with no metrics.
async fn commit_round_zero(store: &SqlStore, run: RunId) {
    let commit = RoundCommit {
        closing: closing(0, 0, RoundOutcome::Commit),
        model_hash: "h1",
        bytes: ModelBytes::Written { model: b"m1", optimizer_state: None },
        metrics: &BTreeMap::new(),
        evaluation: None,
    };
    store.commit_round(run, commit, 4_000).await.unwrap();
}

/// The round of [`run_with_open_round`] with two updates and the aggregator's partial in.
async fn run_with_reports(store: &SqlStore) -> (RunId, [DeviceId; 3]) {
    let (run, [d1, d2, d3]) = run_with_open_round(store).await;
    store
        .insert_update(run, RoundIdx(0), d2, 1, 2, 3, r#"{"loss":2.0}"#, &[5, 6], 1_500)
        .await
        .unwrap();
    store
        .insert_update(run, RoundIdx(0), d1, 0, 0, 1, r#"{"loss":1.0}"#, &[1, 2], 1_600)
        .await
        .unwrap();
    store.insert_partial(run, RoundIdx(0), 2, &partial(d3), 1_650).await.unwrap();
    (run, [d1, d2, d3])
}

async fn enrollment_spends_tokens_and_revocation_is_immediate(store: SqlStore) {
    store.ping().await.unwrap();
    // A token with one use enrolls one device; expired and unknown tokens do not.
    store.create_enrollment_token("tok1", 0, None, Some(1), None).await.unwrap();
    store.create_enrollment_token("expired", 0, Some(10), None, None).await.unwrap();
    let d1 = store.enroll_device("tok1", "cred1", None, 5).await.unwrap();
    assert!(matches!(
        store.enroll_device("tok1", "cred2", None, 5).await,
        Err(StoreError::InvalidToken)
    ));
    assert!(matches!(
        store.enroll_device("expired", "cred2", None, 11).await,
        Err(StoreError::InvalidToken)
    ));
    assert!(matches!(
        store.enroll_device("nope", "cred2", None, 5).await,
        Err(StoreError::InvalidToken)
    ));
    store.create_enrollment_token("tok2", 0, None, None, None).await.unwrap();
    let d2 = store.enroll_device("tok2", "cred2", None, 5).await.unwrap();
    let d3 = store.enroll_device("tok2", "cred3", None, 5).await.unwrap();
    assert!(matches!(
        store.enroll_device("tok2", "cred3", None, 5).await,
        Err(StoreError::Conflict)
    ));
    assert_eq!(store.device_by_credential("cred2").await.unwrap(), Some(d2));
    assert_eq!(store.device_by_credential("unknown").await.unwrap(), None);
    // Revocation: the credential stops working at once, for that device only.
    assert_eq!(store.revoke_device(d2).await.unwrap(), Some(5));
    assert_eq!(store.revoke_device(d2).await.unwrap(), Some(5), "revoking twice is not an error");
    assert_eq!(store.revoke_device(DeviceId(9_999)).await.unwrap(), None);
    assert_eq!(store.device_by_credential("cred2").await.unwrap(), None);
    assert_eq!(store.device_by_credential("cred3").await.unwrap(), Some(d3));
    let listed = store.devices().await.unwrap();
    assert_eq!(
        listed.iter().map(|(d, _, revoked)| (*d, *revoked)).collect::<Vec<_>>(),
        vec![(d1, false), (d2, true), (d3, false)]
    );
}

async fn a_run_starts_with_its_model_version_zero(store: SqlStore) {
    let run = store.create_run(new_run(), 100).await.unwrap();
    assert_eq!(store.running_runs().await.unwrap().len(), 1);
    assert_eq!(store.run(run).await.unwrap().unwrap().population, "p");
    assert_eq!(store.model(run, ModelVersion(0)).await.unwrap().as_deref(), Some(&b"m0"[..]));
    assert_eq!(store.model_by_hash("h0").await.unwrap().as_deref(), Some(&b"m0"[..]));
    assert_eq!(store.model_hash(run, ModelVersion(0)).await.unwrap().as_deref(), Some("h0"));
    assert_eq!(store.open_round(run).await.unwrap(), None);
    assert_eq!(store.last_round_idx(run).await.unwrap(), None);
    assert!(store.run(RunId(999)).await.unwrap().is_none());
}

async fn transitions_are_idempotent_and_the_open_round_comes_back(store: SqlStore) {
    let (run, [d1, d2, d3]) = run_with_open_round(&store).await;
    // Applying the same batch again (a retry whose first answer was lost) changes nothing.
    let again = [
        Transition::OpenRound(opened(0, 0)),
        Transition::Select { round_idx: RoundIdx(0), device: d1, aggregator: None },
    ];
    store.apply_transitions(run, &again, 1_000).await.unwrap();
    let open = store.open_round(run).await.unwrap().expect("round 0 is open");
    assert_eq!(open.round, opened(0, 0));
    assert_eq!(open.selected, vec![d1, d2, d3]);
    assert_eq!(open.assignments, vec![(d3, AggregatorId(7))]);
    assert!(open.reported.is_empty() && open.partials.is_empty());
    assert_eq!(store.last_round_idx(run).await.unwrap(), Some(RoundIdx(0)));
    let rounds = store.rounds(run).await.unwrap();
    assert_eq!(
        (rounds[0].n_selected, rounds[0].n_reported, rounds[0].state.as_str()),
        (Some(3), Some(0), "open")
    );
}

async fn updates_are_durable_once_and_replay_in_slot_order(store: SqlStore) {
    let (run, [d1, d2, _]) = run_with_reports(&store).await;
    assert!(matches!(
        store.insert_update(run, RoundIdx(0), d1, 3, 0, 1, "{}", &[9], 1_700).await,
        Err(StoreError::Conflict)
    ));
    let open = store.open_round(run).await.unwrap().unwrap();
    assert_eq!(open.reported, vec![(d1, 0), (d2, 1)]);
    let mut replayed = vec![];
    let n = store
        .for_each_update(run, RoundIdx(0), |stored| {
            let StoredContribution::Update(u) = stored else { panic!("a group was stored") };
            replayed.push((u.slot, u.staleness, u.delta));
            Ok(())
        })
        .await
        .unwrap();
    assert_eq!(n, 2);
    // An asynchronous run's staleness comes back with its update (a restart folds it with
    // the same discount).
    assert_eq!(replayed, vec![(0, 0, vec![1, 2]), (1, 2, vec![5, 6])]);
}

/// A group of updates is written whole (its sums and a row per update, without a delta but
/// with its norm) or not at all; it replays at its last update's slot, between the updates
/// stored one by one, and is released with its round.
async fn a_group_of_updates_is_durable_whole_and_replays_at_its_last_slot(store: SqlStore) {
    let (run, [d1, d2, d3]) = run_with_open_round(&store).await;
    let member = |device, slot, norm| GroupMember {
        device,
        slot,
        staleness: 0,
        example_count: 2,
        metrics_json: r#"{"loss":0.5}"#.into(),
        norm,
    };
    let group = FoldedGroup {
        sums: PartialSums {
            hi: vec![1.5, -2.25],
            lo: vec![1e-20, 0.0],
            total_weight: 4,
            n_updates: 2,
            metrics: BTreeMap::from([("loss".to_owned(), (2.0, 4))]),
        },
        n_within_bound: 1,
    };
    store.insert_update(run, RoundIdx(0), d1, 0, 0, 1, "{}", &[1, 2], 1_500).await.unwrap();
    // A member already stored (d1) refuses the whole group: nothing of it is left behind.
    let clash = [member(d2, 1, 0.5), member(d1, 2, 0.25)];
    assert!(store.insert_update_group(run, RoundIdx(0), &clash, &group, 1_600).await.is_err());
    let members = [member(d2, 1, 0.5), member(d3, 3, 4.0)];
    let short =
        FoldedGroup { sums: PartialSums { n_updates: 3, ..group.sums.clone() }, ..group.clone() };
    assert!(store.insert_update_group(run, RoundIdx(0), &members, &short, 1_600).await.is_err());
    store.insert_update_group(run, RoundIdx(0), &members, &group, 1_600).await.unwrap();
    assert!(matches!(
        store.insert_update_group(run, RoundIdx(0), &members, &group, 1_650).await,
        Err(StoreError::Conflict)
    ));
    let open = store.open_round(run).await.unwrap().unwrap();
    assert_eq!(open.reported, vec![(d1, 0), (d2, 1), (d3, 3)]);
    assert_eq!(store.rounds(run).await.unwrap()[0].n_reported, Some(3));
    assert!(store.has_update(run, RoundIdx(0), d3).await.unwrap());
    assert_eq!(
        store.grouped_update_norms(run, RoundIdx(0)).await.unwrap(),
        vec![(d2, 0.5), (d3, 4.0)]
    );
    store.insert_update(run, RoundIdx(0), d1, 2, 0, 1, "{}", &[3], 1_700).await.unwrap_err();
    let mut replayed = vec![];
    let n = store
        .for_each_update(run, RoundIdx(0), |stored| {
            replayed.push(stored);
            Ok(())
        })
        .await
        .unwrap();
    assert_eq!(n, 3, "one update and a group of two");
    match &replayed[..] {
        [StoredContribution::Update(u), StoredContribution::Group(g)] => {
            assert_eq!((u.slot, u.delta.as_slice()), (0, &[1u8, 2][..]));
            assert_eq!((g.slot, &g.group), (3, &group), "to the bit, at its last slot");
        }
        other => panic!("replayed {other:?}"),
    }
    commit_round_zero(&store, run).await;
    store.release_payloads(run, RoundIdx(0)).await.unwrap();
    assert_eq!(store.for_each_update(run, RoundIdx(0), |_| Ok(())).await.unwrap(), 0);
    assert!(store.has_update(run, RoundIdx(0), d3).await.unwrap(), "the rows stay");
}

/// Robust aggregation reads a round's updates back a range of values at a time.
async fn update_tiles_are_slices_of_every_update_in_slot_order(store: SqlStore) {
    let (run, [d1, d2, d3]) = run_with_open_round(&store).await;
    let values = |k: f32| (0..7).map(|j| k * 10.0 + j as f32).collect::<Vec<f32>>();
    let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    // Written out of slot order; read back in it.
    for (device, slot, k) in [(d3, 2, 3.0), (d1, 0, 1.0), (d2, 1, 2.0)] {
        store
            .insert_update(run, RoundIdx(0), device, slot, 0, 1, "{}", &bytes(&values(k)), 1_500)
            .await
            .unwrap();
    }
    let tile = store.update_tile(run, RoundIdx(0), 2, 4).await.unwrap();
    assert_eq!(
        tile,
        vec![values(1.0)[2..6].to_vec(), values(2.0)[2..6].to_vec(), values(3.0)[2..6].to_vec()]
    );
    let last = store.update_tile(run, RoundIdx(0), 6, 1).await.unwrap();
    assert_eq!(last, vec![vec![16.0], vec![26.0], vec![36.0]]);
    // Past the end: the store says the updates are not what was asked for.
    assert!(matches!(store.update_tile(run, RoundIdx(0), 6, 2).await, Err(StoreError::Corrupt(_))));
    assert_eq!(store.update_tile(run, RoundIdx(1), 0, 2).await.unwrap(), Vec::<Vec<f32>>::new());
}

async fn partials_are_durable_once_and_count_their_devices(store: SqlStore) {
    let (run, [d1, d2, d3]) = run_with_reports(&store).await;
    assert!(matches!(
        store.insert_partial(run, RoundIdx(0), 2, &partial(d3), 1_650).await,
        Err(StoreError::Conflict)
    ));
    let open = store.open_round(run).await.unwrap().unwrap();
    assert_eq!(
        open.partials,
        vec![StoredPartial { slot: 2, aggregators: vec![AggregatorId(7)], devices: vec![d3] }]
    );
    let reports = store.partial_reports(run, RoundIdx(0)).await.unwrap();
    assert_eq!(reports.len(), 1);
    assert_eq!(reports[0].0, 2);
    assert_eq!(codec::decode::<PartialReport>(&reports[0].1).unwrap(), partial(d3));
    let rounds = store.rounds(run).await.unwrap();
    assert_eq!(rounds[0].n_reported, Some(3), "the partial's device counts as reported");
    // The round's record of devices: each selected one, and how its update arrived.
    let row = |d: DeviceId, agg: Option<i64>, how: &str, n: Option<i64>| RoundDeviceRow {
        device_id: d.0,
        selected_at_ms: 1_000,
        aggregator_id: agg,
        reported: Some(how.to_owned()),
        example_count: n,
    };
    assert_eq!(
        store.round_devices(run, RoundIdx(0)).await.unwrap(),
        vec![
            row(d1, None, "update", Some(1)),
            row(d2, None, "update", Some(3)),
            row(d3, Some(7), "partial", None)
        ]
    );
    assert!(store.round_devices(run, RoundIdx(5)).await.unwrap().is_empty());
}

async fn secure_records_come_back_in_order_and_go_with_the_round(store: SqlStore) {
    let run = store.create_run(new_run(), 100).await.unwrap();
    let first = [Transition::OpenRound(opened(0, 0)), secagg(0, b"begin"), secagg(1, b"second")];
    store.apply_transitions(run, &first, 1_000).await.unwrap();
    store
        .apply_transitions(run, &[secagg(3, b"fourth"), secagg(2, b"third")], 1_700)
        .await
        .unwrap();
    store.apply_transitions(run, &[secagg(1, b"second")], 1_700).await.unwrap();
    let records = store.open_round(run).await.unwrap().unwrap().secure_records;
    assert_eq!(records, [&b"begin"[..], b"second", b"third", b"fourth"].map(<[u8]>::to_vec));
    assert_eq!(store.secagg_record_count(run).await.unwrap(), 4);
    store
        .fail_round(run, closing(0, 0, RoundOutcome::TooFewReports { reported: 0, quorum: 2 }), &[])
        .await
        .unwrap();
    assert_eq!(store.secagg_record_count(run).await.unwrap(), 0);
}

async fn a_commit_advances_the_run_and_releases_payloads(store: SqlStore) {
    let (run, [d1, _, _]) = run_with_reports(&store).await;
    store.apply_transitions(run, &[secagg(0, b"begin")], 1_700).await.unwrap();
    let metrics = BTreeMap::from([("loss".to_owned(), 1.75)]);
    let pooled = PooledEvaluation {
        n_devices: 2,
        example_count: 40,
        metrics: BTreeMap::from([("accuracy".to_owned(), 0.5)]),
    };
    let commit = RoundCommit {
        closing: closing(0, 0, RoundOutcome::Commit),
        model_hash: "h1",
        bytes: ModelBytes::Written { model: b"m1", optimizer_state: Some(b"state after 1") },
        metrics: &metrics,
        evaluation: Some(&pooled),
    };
    store.commit_round(run, commit.clone(), 4_000).await.unwrap();
    assert!(matches!(store.commit_round(run, commit, 4_000).await, Err(StoreError::Conflict)));
    let row = store.run(run).await.unwrap().unwrap();
    assert_eq!((row.model_version, row.rounds_committed), (1, 1));
    assert_eq!(store.model_hash(run, ModelVersion(1)).await.unwrap().as_deref(), Some("h1"));
    // The server optimizer's state goes with the model it produced.
    assert_eq!(
        store.optimizer_state(run, ModelVersion(1)).await.unwrap().as_deref(),
        Some(&b"state after 1"[..])
    );
    assert_eq!(store.optimizer_state(run, ModelVersion(0)).await.unwrap(), None);
    // The payloads go after the commit, in a transaction of their own.
    assert_eq!(store.for_each_update(run, RoundIdx(0), |_| Ok(())).await.unwrap(), 2);
    store.release_payloads(run, RoundIdx(0)).await.unwrap();
    store.release_payloads(run, RoundIdx(0)).await.unwrap();
    assert_eq!(store.for_each_update(run, RoundIdx(0), |_| Ok(())).await.unwrap(), 0);
    assert!(store.partial_reports(run, RoundIdx(0)).await.unwrap().is_empty(), "sums released");
    assert_eq!(store.open_round(run).await.unwrap(), None);
    assert_eq!(store.secagg_record_count(run).await.unwrap(), 0, "records go with the round");
    let r0 = &store.rounds(run).await.unwrap()[0];
    assert_eq!((r0.state.as_str(), r0.n_reported, r0.n_dropped), ("committed", Some(2), Some(1)));
    assert_eq!(r0.metrics_json.as_deref(), Some(r#"{"loss":1.75}"#));
    assert_eq!(
        store.round_devices(run, RoundIdx(0)).await.unwrap().len(),
        3,
        "who took part outlives the payloads"
    );
    // A secure cohort's pooled evaluation of the version the round trained on.
    let pooled_rows = store.aggregate_evaluations(run).await.unwrap();
    assert_eq!(
        pooled_rows
            .iter()
            .map(|e| (e.model_version, e.n_devices, e.example_count, e.metrics_json.as_str()))
            .collect::<Vec<_>>(),
        vec![(0, 2, 40, r#"{"accuracy":0.5}"#)]
    );
    // Devices selected for a round on version 0 may evaluate it; others may not.
    assert!(store.selected_for_version(run, d1, ModelVersion(0)).await.unwrap());
    assert!(!store.selected_for_version(run, d1, ModelVersion(1)).await.unwrap());
    let models = store.models(run).await.unwrap();
    assert_eq!(
        models.iter().map(|m| (m.version, m.round_idx)).collect::<Vec<_>>(),
        vec![(0, None), (1, Some(0))]
    );
}

/// An evaluation-only round commits its pooled reports: the round is "evaluated" with their
/// metrics, the run counts it without a new model version, the reports' rows are released, and
/// a retried commit (its answer lost) is a conflict, as for a training round.
async fn an_evaluation_round_records_its_reports_and_keeps_the_model(store: SqlStore) {
    let (run, _) = run_with_reports(&store).await;
    let pooled = PooledEvaluation {
        n_devices: 2,
        example_count: 40,
        metrics: BTreeMap::from([("accuracy".to_owned(), 0.75)]),
    };
    let evaluated = closing(0, 0, RoundOutcome::Commit);
    store.commit_evaluation_round(run, evaluated, &pooled, 4_000).await.unwrap();
    let again = store.commit_evaluation_round(run, evaluated, &pooled, 4_000).await;
    assert!(matches!(again, Err(StoreError::Conflict)), "{again:?}");
    let row = store.run(run).await.unwrap().unwrap();
    assert_eq!((row.model_version, row.rounds_committed), (0, 1));
    assert_eq!(store.models(run).await.unwrap().len(), 1, "no model version added");
    let r0 = &store.rounds(run).await.unwrap()[0];
    assert_eq!(r0.state, "evaluated");
    assert_eq!(r0.metrics_json.as_deref(), Some(r#"{"accuracy":0.75}"#));
    assert_eq!(store.for_each_update(run, RoundIdx(0), |_| Ok(())).await.unwrap(), 0);
    assert_eq!(store.open_round(run).await.unwrap(), None);
    let rows = store.aggregate_evaluations(run).await.unwrap();
    assert_eq!(
        rows.iter().map(|e| (e.model_version, e.source.as_str(), e.n_devices)).collect::<Vec<_>>(),
        vec![(0, "evaluation_round:0", 2)]
    );
}

async fn a_failed_round_records_its_outcome_once(store: SqlStore) {
    let (run, _) = run_with_reports(&store).await;
    let failed = closing(0, 0, RoundOutcome::TooFewReports { reported: 2, quorum: 3 });
    store.fail_round(run, failed, &[]).await.unwrap();
    assert!(matches!(store.fail_round(run, failed, &[]).await, Err(StoreError::Corrupt(_))));
    let r0 = &store.rounds(run).await.unwrap()[0];
    assert_eq!(r0.state, "failed");
    assert_eq!(
        r0.outcome_json.as_deref(),
        Some(r#"{"outcome":"too_few_reports","reported":2,"quorum":3}"#)
    );
    assert_eq!(store.for_each_update(run, RoundIdx(0), |_| Ok(())).await.unwrap(), 0);
    let row = store.run(run).await.unwrap().unwrap();
    assert_eq!((row.model_version, row.rounds_committed, row.status.as_str()), (0, 0, "running"));
}

async fn evaluations_are_one_per_device_and_version(store: SqlStore) {
    let (run, [d1, d2, _]) = run_with_open_round(&store).await;
    store
        .insert_evaluation(run, d1, ModelVersion(0), 10, r#"{"accuracy":0.5}"#, 6_000)
        .await
        .unwrap();
    store
        .insert_evaluation(run, d2, ModelVersion(0), 20, r#"{"accuracy":0.8}"#, 6_000)
        .await
        .unwrap();
    assert!(matches!(
        store.insert_evaluation(run, d1, ModelVersion(0), 10, "{}", 6_000).await,
        Err(StoreError::Conflict)
    ));
    let rows = store.evaluations(run).await.unwrap();
    assert_eq!(rows.iter().map(|e| e.example_count).collect::<Vec<_>>(), vec![10, 20]);
}

async fn stopping_a_run_fails_its_open_round(store: SqlStore) {
    let run = store.create_run(new_run(), 100).await.unwrap();
    let record = Transition::SecAggRecord { round_idx: RoundIdx(2), seq: 0, record: b"x".to_vec() };
    store
        .apply_transitions(run, &[Transition::OpenRound(opened(2, 0)), record], 7_000)
        .await
        .unwrap();
    assert_eq!(store.secagg_record_count(run).await.unwrap(), 1);
    let stop = Transition::StopRun { open_round: Some(RoundIdx(2)), reason: None };
    store.apply_transitions(run, &[stop], 7_000).await.unwrap();
    let row = store.run(run).await.unwrap().unwrap();
    assert_eq!((row.status.as_str(), row.stop_reason), ("stopped", None), "the operator's stop");
    assert!(store.running_runs().await.unwrap().is_empty());
    assert_eq!(store.rounds(run).await.unwrap()[0].state, "failed");
    assert_eq!(store.secagg_record_count(run).await.unwrap(), 0);
    // The coordinator's stop keeps its reason with the run.
    let other = store.create_run(new_run(), 100).await.unwrap();
    let reason = Some("5 rounds in a row failed".to_owned());
    store
        .apply_transitions(other, &[Transition::StopRun { open_round: None, reason }], 8_000)
        .await
        .unwrap();
    let row = store.run(other).await.unwrap().unwrap();
    assert_eq!(row.stop_reason.as_deref(), Some("5 rounds in a row failed"));
}

/// An asynchronous run's devices still training on a closed round's model: selected there,
/// no update since, not selected again, and the round's model no older than asked.
async fn carried_tasks_are_the_selected_devices_not_heard_from_since(store: SqlStore) {
    let (run, [d1, d2, d3]) = run_with_open_round(&store).await;
    store.insert_update(run, RoundIdx(0), d1, 0, 0, 1, "{}", &[1, 2], 1_500).await.unwrap();
    // Nothing is carried out of the open round itself.
    assert_eq!(store.carried_tasks(run, ModelVersion(0)).await.unwrap(), vec![]);
    let failed = closing(0, 0, RoundOutcome::TooFewReports { reported: 1, quorum: 2 });
    store.fail_round(run, failed, &[]).await.unwrap();
    let next = [
        Transition::OpenRound(opened(1, 0)),
        Transition::Select { round_idx: RoundIdx(1), device: d3, aggregator: None },
    ];
    store.apply_transitions(run, &next, 4_500).await.unwrap();
    let d2_task = CarriedTask {
        device: d2,
        round_idx: RoundIdx(0),
        model_version: ModelVersion(0),
        selected_at: 1_000,
    };
    assert_eq!(store.carried_tasks(run, ModelVersion(0)).await.unwrap(), vec![d2_task]);
    assert_eq!(store.carried_tasks(run, ModelVersion(1)).await.unwrap(), vec![], "too old");
    // Its late update lands in the open round: it is carried no more.
    store.insert_update(run, RoundIdx(1), d2, 0, 1, 1, "{}", &[3, 4], 4_600).await.unwrap();
    assert_eq!(store.carried_tasks(run, ModelVersion(0)).await.unwrap(), vec![]);
}

/// What tells a retried upload whose answer was lost (`duplicate_upload`) from a late one
/// (`round_closed`): the device's update for that task is durable, released bytes or not, in
/// its own round or, carried by a buffered run, in a later one that did not select it again.
async fn a_durable_update_is_found_for_its_task_after_its_round_closed(store: SqlStore) {
    let (run, [d1, d2, d3]) = run_with_open_round(&store).await;
    store.insert_update(run, RoundIdx(0), d1, 0, 0, 1, "{}", &[1, 2], 1_500).await.unwrap();
    assert!(store.has_update(run, RoundIdx(0), d1).await.unwrap(), "in the open round");
    assert!(!store.has_update(run, RoundIdx(0), d2).await.unwrap(), "d2 has not reported");
    commit_round_zero(&store, run).await;
    store.release_payloads(run, RoundIdx(0)).await.unwrap();
    assert!(store.has_update(run, RoundIdx(0), d1).await.unwrap(), "released, still durable");
    // Round 1 selects d3 again; d2, still training on model 0, reports into it (carried).
    let next = [
        Transition::OpenRound(opened(1, 1)),
        Transition::Select { round_idx: RoundIdx(1), device: d3, aggregator: None },
    ];
    store.apply_transitions(run, &next, 4_500).await.unwrap();
    store.insert_update(run, RoundIdx(1), d2, 0, 1, 1, "{}", &[3, 4], 4_600).await.unwrap();
    store.insert_update(run, RoundIdx(1), d3, 1, 0, 1, "{}", &[5, 6], 4_700).await.unwrap();
    assert!(store.has_update(run, RoundIdx(0), d2).await.unwrap(), "carried into round 1");
    assert!(
        !store.has_update(run, RoundIdx(0), d3).await.unwrap(),
        "d3's update answers its round-1 task, not its silent round-0 one"
    );
    assert!(store.has_update(run, RoundIdx(1), d3).await.unwrap());
    assert!(!store.has_update(run, RoundIdx(1), d1).await.unwrap());
}

/// A commit leaves its round's payloads to a later release (or to the sweep at start, for a
/// coordinator stopped in between); an open round's are never released.
async fn payloads_are_released_only_once_their_round_closed(store: SqlStore) {
    let (run, [d1, _, _]) = run_with_reports(&store).await;
    assert!(matches!(store.release_payloads(run, RoundIdx(0)).await, Err(StoreError::Corrupt(_))));
    assert!(matches!(store.release_payloads(run, RoundIdx(7)).await, Err(StoreError::Corrupt(_))));
    assert_eq!(store.release_closed_payloads().await.unwrap(), 0, "the open round keeps its");
    assert_eq!(store.for_each_update(run, RoundIdx(0), |_| Ok(())).await.unwrap(), 2);
    commit_round_zero(&store, run).await;
    // The next round opens and takes an update before the sweep: that one stays.
    let select = Transition::Select { round_idx: RoundIdx(1), device: d1, aggregator: None };
    store
        .apply_transitions(run, &[Transition::OpenRound(opened(1, 1)), select], 4_100)
        .await
        .unwrap();
    store.insert_update(run, RoundIdx(1), d1, 0, 0, 4, "{}", &[9], 4_200).await.unwrap();
    assert_eq!(store.release_closed_payloads().await.unwrap(), 1);
    assert_eq!(store.for_each_update(run, RoundIdx(0), |_| Ok(())).await.unwrap(), 0);
    assert!(store.partial_reports(run, RoundIdx(0)).await.unwrap().is_empty());
    assert_eq!(store.for_each_update(run, RoundIdx(1), |_| Ok(())).await.unwrap(), 1);
    assert_eq!(store.release_closed_payloads().await.unwrap(), 0, "nothing left to release");
}

/// A run's writer writes the batches that queued during its last write in one
/// transaction; each keeps its own time, and they apply in order (a round opened in the first
/// is there for the second's selections).
async fn batches_written_together_keep_their_order_and_their_times(store: SqlStore) {
    let [d1, d2, d3] = devices(&store).await;
    let run = store.create_run(new_run(), 100).await.unwrap();
    let select = |device| Transition::Select { round_idx: RoundIdx(0), device, aggregator: None };
    let first = [Transition::OpenRound(opened(0, 0)), select(d1)];
    let second = [select(d2), select(d3)];
    store
        .apply_transition_batches(run, &[(&first, 1_000), (&[], 1_100), (&second, 1_200)])
        .await
        .unwrap();
    let open = store.open_round(run).await.unwrap().expect("round 0 is open");
    assert_eq!(open.selected, vec![d1, d2, d3]);
    let times: Vec<(i64, i64)> = store
        .round_devices(run, RoundIdx(0))
        .await
        .unwrap()
        .iter()
        .map(|d| (d.device_id, d.selected_at_ms))
        .collect();
    assert_eq!(times, vec![(d1.0, 1_000), (d2.0, 1_200), (d3.0, 1_200)]);
    // Nothing to write is not an error, and writes nothing.
    store.apply_transition_batches(run, &[(&[], 1_300)]).await.unwrap();
    assert_eq!(store.round_devices(run, RoundIdx(0)).await.unwrap().len(), 3);
    // Consecutive selections go in one statement: one that repeats a device (a retry of a
    // batch whose answer was lost) keeps the first selection, and is not an error.
    let retried = [select(d3), select(d1), select(d3)];
    store.apply_transition_batches(run, &[(&retried, 1_400)]).await.unwrap();
    let times: Vec<i64> = store
        .round_devices(run, RoundIdx(0))
        .await
        .unwrap()
        .iter()
        .map(|d| d.selected_at_ms)
        .collect();
    assert_eq!(times, vec![1_000, 1_200, 1_200]);
}

/// A round whose model is determined by durable inputs commits it by its hash; the
/// bytes (and the server's state) follow. Until they land the model reads as pending, the
/// round's payloads stay (a restart rebuilds the model from them) and a wrong hash is refused.
async fn a_model_committed_by_its_hash_keeps_its_round_payloads_until_written(store: SqlStore) {
    let (run, _) = run_with_reports(&store).await;
    let metrics = BTreeMap::new();
    let commit = RoundCommit {
        closing: closing(0, 0, RoundOutcome::Commit),
        model_hash: "h1",
        bytes: ModelBytes::Later,
        metrics: &metrics,
        evaluation: None,
    };
    store.commit_round(run, commit, 4_000).await.unwrap();
    let row = store.run(run).await.unwrap().unwrap();
    assert_eq!((row.model_version, row.rounds_committed), (1, 1));
    assert_eq!(store.model_hash(run, ModelVersion(1)).await.unwrap().as_deref(), Some("h1"));
    let pending =
        PendingModel { run_id: run.0, version: 1, content_hash: "h1".into(), round_idx: 0 };
    assert_eq!(store.pending_models().await.unwrap(), vec![pending]);
    let is_pending =
        |e| matches!(e, StoreError::ModelPending { run_id, version: 1 } if run_id == run.0);
    assert!(is_pending(store.model(run, ModelVersion(1)).await.unwrap_err()));
    assert!(is_pending(store.model_by_hash("h1").await.unwrap_err()));
    assert_eq!(store.model(run, ModelVersion(0)).await.unwrap().as_deref(), Some(&b"m0"[..]));
    // The payloads are what a restart would rebuild it from.
    assert!(matches!(store.release_payloads(run, RoundIdx(0)).await, Err(StoreError::Corrupt(_))));
    assert_eq!(store.release_closed_payloads().await.unwrap(), 0);
    assert_eq!(store.for_each_update(run, RoundIdx(0), |_| Ok(())).await.unwrap(), 2);
    // Bytes for another hash, or for a version never committed, are refused.
    let refused = store.write_model(run, ModelVersion(1), "h2", b"m2", None).await;
    assert!(matches!(refused, Err(StoreError::Corrupt(_))), "{refused:?}");
    let refused = store.write_model(run, ModelVersion(2), "h1", b"m1", None).await;
    assert!(matches!(refused, Err(StoreError::Corrupt(_))), "{refused:?}");
    assert!(is_pending(store.model(run, ModelVersion(1)).await.unwrap_err()));
    store.write_model(run, ModelVersion(1), "h1", b"m1", Some(b"state after 1")).await.unwrap();
    // Twice is a retry whose answer was lost, and changes nothing.
    store.write_model(run, ModelVersion(1), "h1", b"other", None).await.unwrap();
    assert_eq!(store.model(run, ModelVersion(1)).await.unwrap().as_deref(), Some(&b"m1"[..]));
    assert_eq!(store.model_by_hash("h1").await.unwrap().as_deref(), Some(&b"m1"[..]));
    assert_eq!(
        store.optimizer_state(run, ModelVersion(1)).await.unwrap().as_deref(),
        Some(&b"state after 1"[..])
    );
    assert_eq!(store.pending_models().await.unwrap(), vec![]);
    assert_eq!(store.release_closed_payloads().await.unwrap(), 1);
    assert_eq!(store.for_each_update(run, RoundIdx(0), |_| Ok(())).await.unwrap(), 0);
}

/// With a plan's `checkpoint_interval`, rounds commit several models by their hash
/// before one is written. Until then every one of them is pending and its round keeps its
/// updates (a restart rebuilds them in order); once a later version is written, the ones
/// before it are given up: not pending, read as not kept, their rounds' updates released.
async fn models_between_checkpoints_are_given_up_once_a_later_one_is_written(store: SqlStore) {
    let (run, [d1, ..]) = run_with_reports(&store).await;
    let metrics = BTreeMap::new();
    let commit = |round: i64, hash: &'static str| RoundCommit {
        closing: closing(round, round, RoundOutcome::Commit),
        model_hash: hash,
        bytes: ModelBytes::Later,
        metrics: &metrics,
        evaluation: None,
    };
    store.commit_round(run, commit(0, "h1"), 4_000).await.unwrap();
    for (round, hash) in [(1, "h2"), (2, "h3")] {
        let open = [
            Transition::OpenRound(opened(round, round)),
            Transition::Select { round_idx: RoundIdx(round), device: d1, aggregator: None },
        ];
        store.apply_transitions(run, &open, 5_000).await.unwrap();
        store.insert_update(run, RoundIdx(round), d1, 0, 0, 1, "{}", &[7, 8], 5_500).await.unwrap();
        store.commit_round(run, commit(round, hash), 6_000).await.unwrap();
    }
    let pending = |version: i64, hash: &str| PendingModel {
        run_id: run.0,
        version,
        content_hash: hash.into(),
        round_idx: version - 1,
    };
    assert_eq!(
        store.pending_models().await.unwrap(),
        vec![pending(1, "h1"), pending(2, "h2"), pending(3, "h3")],
        "a restart rebuilds all three, oldest first"
    );
    assert!(store.model_still_to_be_written(run, ModelVersion(2)).await.unwrap());
    assert!(!store.model_still_to_be_written(run, ModelVersion(0)).await.unwrap());
    assert!(matches!(
        store.model(run, ModelVersion(1)).await,
        Err(StoreError::ModelPending { .. })
    ));
    assert!(matches!(store.release_payloads(run, RoundIdx(1)).await, Err(StoreError::Corrupt(_))));
    assert_eq!(store.release_closed_payloads().await.unwrap(), 0);
    // The third is written: the two before it are given up.
    store.write_model(run, ModelVersion(3), "h3", b"m3", Some(b"state after 3")).await.unwrap();
    assert_eq!(store.pending_models().await.unwrap(), vec![]);
    assert!(!store.model_still_to_be_written(run, ModelVersion(3)).await.unwrap());
    let not_kept = |e: StoreError, v: i64| matches!(e, StoreError::ModelNotKept { run_id, version } if run_id == run.0 && version == v);
    assert!(not_kept(store.model(run, ModelVersion(1)).await.unwrap_err(), 1));
    assert!(not_kept(store.model_by_hash("h2").await.unwrap_err(), 2));
    assert_eq!(store.model(run, ModelVersion(3)).await.unwrap().as_deref(), Some(&b"m3"[..]));
    assert_eq!(store.model_hash(run, ModelVersion(2)).await.unwrap().as_deref(), Some("h2"));
    // The rounds of the versions it stands for release their updates (each round once).
    let released = store.release_payloads_of_versions(run, ModelVersion(1), ModelVersion(3));
    assert_eq!(released.await.unwrap(), 3);
    for round in 0..3 {
        let left = store.for_each_update(run, RoundIdx(round), |_| Ok(())).await.unwrap();
        assert_eq!(left, 0, "round {round}");
    }
    assert_eq!(store.release_closed_payloads().await.unwrap(), 0);
    // A version committed after the written one is pending again, not given up.
    let open = [
        Transition::OpenRound(opened(3, 3)),
        Transition::Select { round_idx: RoundIdx(3), device: d1, aggregator: None },
    ];
    store.apply_transitions(run, &open, 7_000).await.unwrap();
    store.insert_update(run, RoundIdx(3), d1, 0, 0, 1, "{}", &[9], 7_500).await.unwrap();
    store.commit_round(run, commit(3, "h4"), 8_000).await.unwrap();
    assert_eq!(store.pending_models().await.unwrap(), vec![pending(4, "h4")]);
    assert!(matches!(
        store.model(run, ModelVersion(4)).await,
        Err(StoreError::ModelPending { .. })
    ));
    assert_eq!(store.release_closed_payloads().await.unwrap(), 0, "round 3 keeps its update");
}

/// Regression: a model read while its bytes were being written could answer "not
/// kept" (a run that keeps every version): the read saw no bytes, the write landed, and the
/// second query, asking whether the version was still to be written, saw it written. A reader
/// racing each write now sees the model pending or its bytes, never given up.
async fn a_model_read_while_its_bytes_are_written_is_pending_or_there(store: SqlStore) {
    const VERSIONS: i64 = 12;
    let (run, [d1, ..]) = run_with_reports(&store).await;
    let metrics = BTreeMap::new();
    let hash = |version: i64| format!("h{version}");
    for round in 0..VERSIONS {
        if round > 0 {
            let open = [
                Transition::OpenRound(opened(round, round)),
                Transition::Select { round_idx: RoundIdx(round), device: d1, aggregator: None },
            ];
            store.apply_transitions(run, &open, 5_000).await.unwrap();
            store
                .insert_update(run, RoundIdx(round), d1, 0, 0, 1, "{}", &[7], 5_500)
                .await
                .unwrap();
        }
        let model_hash = hash(round + 1);
        let commit = RoundCommit {
            closing: closing(round, round, RoundOutcome::Commit),
            model_hash: &model_hash,
            bytes: ModelBytes::Later,
            metrics: &metrics,
            evaluation: None,
        };
        store.commit_round(run, commit, 6_000).await.unwrap();
    }
    for version in 1..=VERSIONS {
        let reader = tokio::spawn({
            let store = store.clone();
            async move {
                for read in 0.. {
                    let answer = match read % 2 {
                        0 => store.model(run, ModelVersion(version)).await,
                        _ => store.model_by_hash(&format!("h{version}")).await,
                    };
                    match answer {
                        Err(StoreError::ModelPending { .. }) => continue,
                        Ok(Some(bytes)) => return Ok(bytes),
                        other => return Err(format!("read {read}: {other:?}")),
                    }
                }
                unreachable!("the loop only ends by returning")
            }
        });
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        let model = format!("m{version}");
        store
            .write_model(run, ModelVersion(version), &hash(version), model.as_bytes(), None)
            .await
            .unwrap();
        let read = reader.await.unwrap();
        assert_eq!(read, Ok(model.into_bytes()), "version {version}");
    }
}

/// A token names the populations its devices may join, and every device it enrolls carries
/// them; a device of a token from before populations were named may join any.
async fn devices_may_join_only_the_populations_their_token_names(store: SqlStore) {
    let named = ["fleet-a".to_owned(), "fleet-b".to_owned()];
    store.create_enrollment_token("named", 0, None, Some(2), Some(&named)).await.unwrap();
    store.create_enrollment_token("legacy", 0, None, Some(1), None).await.unwrap();
    let d = store.enroll_device("named", "cred-named", None, 1).await.unwrap();
    let old = store.enroll_device("legacy", "cred-legacy", None, 1).await.unwrap();
    let access = store.device_access("cred-named").await.unwrap().unwrap();
    assert_eq!(access.device, d);
    assert_eq!(access.populations.as_deref(), Some(&named[..]));
    assert!(access.may_join("fleet-a") && access.may_join("fleet-b"));
    assert!(!access.may_join("default") && !access.may_join("fleet-c"));
    let legacy = store.device_access("cred-legacy").await.unwrap().unwrap();
    assert_eq!((legacy.device, legacy.populations.clone()), (old, None));
    assert!(legacy.may_join("anything"));
    assert_eq!(store.device_access("unknown").await.unwrap(), None);
}

/// The identity key a device enrolls with comes back with every authentication, so the fleet
/// API can check that its secure-aggregation keys are signed by it; a device enrolled without
/// one has none.
async fn a_device_keeps_the_identity_key_it_enrolled_with(store: SqlStore) {
    store.create_enrollment_token("tok", 0, None, Some(2), None).await.unwrap();
    let key: [u8; 32] = std::array::from_fn(|i| i as u8 * 7);
    let d = store.enroll_device("tok", "cred-signing", Some(key), 1).await.unwrap();
    let bare = store.enroll_device("tok", "cred-bare", None, 1).await.unwrap();
    let access = store.device_access("cred-signing").await.unwrap().unwrap();
    assert_eq!((access.device, access.identity_key), (d, Some(key)));
    let access = store.device_access("cred-bare").await.unwrap().unwrap();
    assert_eq!((access.device, access.identity_key), (bare, None));
}

/// A run created with `exclusive_population` claims its population: no other run starts there
/// while it runs, it is refused while another runs there, and of two claims one wins (the
/// claims table's key). Once the claiming run stops, the population is free again.
async fn a_population_a_run_claims_is_busy_for_every_other_run_while_it_runs(store: SqlStore) {
    let claim = |population| NewRun { population, exclusive_population: true, ..new_run() };
    let plain = |population| NewRun { population, ..new_run() };
    let alone = store.create_run(claim("sim"), 1).await.unwrap();
    for refused in [claim("sim"), plain("sim")] {
        let err = store.create_run(refused, 2).await.unwrap_err();
        assert!(
            matches!(&err, StoreError::PopulationBusy { run, exclusive: true, .. } if *run == alone.0),
            "{err}"
        );
    }
    // A population with a plain run in it cannot be claimed.
    let shared = store.create_run(plain("shared"), 3).await.unwrap();
    let err = store.create_run(claim("shared"), 4).await.unwrap_err();
    assert!(
        matches!(&err, StoreError::PopulationBusy { run, exclusive: false, .. } if *run == shared.0),
        "{err}"
    );
    store.create_run(plain("shared"), 5).await.unwrap();
    // Two claims at once on a free population: exactly one wins.
    let (a, b) =
        tokio::join!(store.create_run(claim("race"), 6), store.create_run(claim("race"), 6));
    assert_eq!(usize::from(a.is_ok()) + usize::from(b.is_ok()), 1, "{a:?} {b:?}");
    // The claim ends with its run.
    store
        .apply_transitions(alone, &[Transition::StopRun { open_round: None, reason: None }], 7)
        .await
        .unwrap();
    store.create_run(claim("sim"), 8).await.unwrap();
}

/// The quarantine rule's strikes, counted from the store: rounds whose aggregate was refused
/// strike each device they held, by update or partial; other failures count neither way.
async fn quarantine_strikes_count_refused_rounds_by_updates_and_partials(store: SqlStore) {
    let (run, [d1, d2, d3]) = run_with_reports(&store).await;
    store.fail_round(run, closing(0, 0, RoundOutcome::AggregateRejected), &[]).await.unwrap();
    for round in 1..3 {
        let batch = [
            Transition::OpenRound(opened(round, 0)),
            Transition::Select { round_idx: RoundIdx(round), device: d1, aggregator: None },
            Transition::Select { round_idx: RoundIdx(round), device: d3, aggregator: None },
        ];
        store.apply_transitions(run, &batch, 4_500).await.unwrap();
        store.insert_update(run, RoundIdx(round), d1, 0, 0, 1, "{}", &[1], 4_600).await.unwrap();
        store.insert_update(run, RoundIdx(round), d3, 1, 0, 1, "{}", &[1], 4_600).await.unwrap();
        let outcome = match round {
            1 => RoundOutcome::AggregateRejected,
            _ => RoundOutcome::TooFewReports { reported: 2, quorum: 3 },
        };
        store.fail_round(run, closing(round, 0, outcome), &[]).await.unwrap();
    }
    let strikes = store.quarantine_strikes(run).await.unwrap();
    let mut expected = Strikes::default();
    expected.round_ended([d2, d1, d3], false);
    expected.round_ended([d1, d3], false);
    assert_eq!(strikes, expected);
    assert!(!strikes.quarantines(d1), "two refused rounds; the third failed otherwise");
    // A refusal traced to d3's update strikes d3 alone: its third, d1 keeps two.
    let batch = [
        Transition::OpenRound(opened(3, 0)),
        Transition::Select { round_idx: RoundIdx(3), device: d1, aggregator: None },
        Transition::Select { round_idx: RoundIdx(3), device: d3, aggregator: None },
    ];
    store.apply_transitions(run, &batch, 5_000).await.unwrap();
    store.insert_update(run, RoundIdx(3), d1, 0, 0, 1, "{}", &[1], 5_100).await.unwrap();
    store.insert_update(run, RoundIdx(3), d3, 1, 0, 1, "{}", &[1], 5_100).await.unwrap();
    let refused = closing(3, 0, RoundOutcome::AggregateRejected);
    store.fail_round(run, refused, &[d3]).await.unwrap();
    let strikes = store.quarantine_strikes(run).await.unwrap();
    expected.round_ended([d3], false);
    assert_eq!(strikes, expected);
    assert!(strikes.quarantines(d3) && !strikes.quarantines(d1));
    let r3 = &store.rounds(run).await.unwrap()[3];
    let outcome: serde_json::Value =
        serde_json::from_str(r3.outcome_json.as_deref().unwrap()).unwrap();
    assert_eq!(outcome, serde_json::json!({"outcome": "aggregate_rejected", "culprits": [d3.0]}));
}

/// A `blt_ftrl` run's participation rule counts every selection the store holds, in failed
/// rounds and the open one too, with the latest model version each device was selected on:
/// what a restarted or new leader enforces the rule from.
async fn participation_history_counts_every_selection_with_its_latest_model(store: SqlStore) {
    let (run, [d1, d2, d3]) = run_with_open_round(&store).await;
    let failed = RoundOutcome::TooFewReports { reported: 0, quorum: 3 };
    store.fail_round(run, closing(0, 0, failed), &[]).await.unwrap();
    for (round, version) in [(1, 0), (2, 3)] {
        let batch = [
            Transition::OpenRound(opened(round, version)),
            Transition::Select { round_idx: RoundIdx(round), device: d1, aggregator: None },
        ];
        store.apply_transitions(run, &batch, 4_500).await.unwrap();
        if round == 1 {
            store.fail_round(run, closing(round, version, failed), &[]).await.unwrap();
        }
    }
    let history = store.participation_history(run).await.unwrap();
    assert_eq!(history.history(d1), Some(History { count: 3, last: ModelVersion(3) }));
    for d in [d2, d3] {
        assert_eq!(history.history(d), Some(History { count: 1, last: ModelVersion(0) }));
    }
    assert_eq!(history.history(DeviceId(d3.0 + 100)), None);
    let other = store.create_run(new_run(), 100).await.unwrap();
    assert_eq!(store.participation_history(other).await.unwrap().history(d1), None);
}

/// An imported model comes back by its hash with its tensors and values; importing it again
/// keeps the first import; the list has each model once, oldest first.
async fn an_imported_model_is_kept_once_by_its_hash(store: SqlStore) {
    use starling_core::tensor::{DType, TensorSchema, TensorSpec};
    let schema = TensorSchema {
        tensors: vec![
            TensorSpec { name: "a".into(), shape: vec![2, 2], dtype: DType::F32 },
            TensorSpec { name: "b".into(), shape: vec![3], dtype: DType::F32 },
        ],
    };
    let data: Vec<u8> = (0..28).collect();
    assert_eq!(store.base_model("h1").await.unwrap(), None);
    let first = store.put_base_model("h1", "first", &schema, &data, 1_000).await.unwrap();
    let again = store.put_base_model("h1", "again", &schema, &data, 2_000).await.unwrap();
    assert_eq!(again, first, "the first import stands");
    store.put_base_model("h2", "second", &schema, &data[..16], 3_000).await.unwrap();
    let (info, values) = store.base_model("h1").await.unwrap().unwrap();
    assert_eq!((info.name.as_str(), info.bytes, info.created_at_ms), ("first", 28, 1_000));
    assert_eq!(info, first);
    assert_eq!(info.schema().unwrap(), schema);
    assert_eq!(values, data);
    let listed: Vec<(String, i64)> =
        store.base_models().await.unwrap().into_iter().map(|b| (b.name, b.bytes)).collect();
    assert_eq!(listed, [("first".to_owned(), 28), ("second".to_owned(), 16)]);
}

async fn an_imported_tokenizer_is_kept_once_by_its_hash(store: SqlStore) {
    let file = br#"{"model": {}}"#.to_vec();
    assert_eq!(store.tokenizer_info("t1").await.unwrap(), None);
    assert_eq!(store.tokenizer_file("t1").await.unwrap(), None);
    let first = store.put_tokenizer("t1", "first", 300, &file, 1_000).await.unwrap();
    let again = store.put_tokenizer("t1", "again", 301, &file, 2_000).await.unwrap();
    assert_eq!(again, first, "the first import stands");
    assert_eq!(
        (first.name.as_str(), first.vocab_size, first.bytes, first.created_at_ms),
        ("first", 300, file.len() as i64, 1_000)
    );
    store.put_tokenizer("t2", "second", 50_257, b"{}", 3_000).await.unwrap();
    assert_eq!(store.tokenizer_file("t1").await.unwrap(), Some(file));
    let listed: Vec<(String, i64)> =
        store.tokenizers().await.unwrap().into_iter().map(|t| (t.name, t.vocab_size)).collect();
    assert_eq!(listed, [("first".to_owned(), 300), ("second".to_owned(), 50_257)]);
}

/// A replica's relayed requests: the leader takes each once, oldest first, within its limit;
/// an answer goes to the replica that relayed it, once; a request not taken yet can be
/// withdrawn and one taken cannot; a new leader takes again what was taken and never answered.
async fn relayed_requests_are_taken_once_in_order_and_answered_to_their_replica(store: SqlStore) {
    let (replica, other) = (7, -3);
    let a = store.relay_request(replica, b"a", 1_000).await.unwrap();
    let b = store.relay_request(other, b"b", 1_001).await.unwrap();
    let c = store.relay_request(replica, b"c", 1_002).await.unwrap();
    assert!(a < b && b < c, "ids in arrival order");
    let taken = store.take_relayed(2, 2_000).await.unwrap();
    let taken: Vec<(i64, Vec<u8>)> = taken.into_iter().map(|r| (r.id, r.request)).collect();
    assert_eq!(taken, [(a, b"a".to_vec()), (b, b"b".to_vec())], "oldest first, at most 2");
    assert!(!store.withdraw_relayed(a).await.unwrap(), "a taken request stays");
    assert!(store.withdraw_relayed(c).await.unwrap(), "one not taken is withdrawn");
    assert!(store.take_relayed(10, 2_001).await.unwrap().is_empty(), "nothing taken twice");

    assert!(store.collect_relayed_answers(replica).await.unwrap().is_empty());
    store.answer_relayed(&[(a, b"answer a".to_vec())], 3_000).await.unwrap();
    assert!(store.collect_relayed_answers(other).await.unwrap().is_empty(), "not its answer");
    assert_eq!(store.collect_relayed_answers(replica).await.unwrap(), [(a, b"answer a".to_vec())]);
    assert!(store.collect_relayed_answers(replica).await.unwrap().is_empty(), "read once");
    let (e, f) = (
        store.relay_request(replica, b"e", 3_001).await.unwrap(),
        store.relay_request(replica, b"f", 3_002).await.unwrap(),
    );
    store.take_relayed(2, 3_003).await.unwrap();
    store.answer_relayed(&[(f, b"answer f".to_vec()), (e, vec![])], 3_004).await.unwrap();
    let mut answers = store.collect_relayed_answers(replica).await.unwrap();
    answers.sort();
    assert_eq!(answers, [(e, vec![]), (f, b"answer f".to_vec())], "answered together");

    // A new leader: b was taken and never answered, so it is taken again.
    assert_eq!(store.retake_unanswered_relayed().await.unwrap(), 1);
    let again: Vec<i64> =
        store.take_relayed(10, 4_000).await.unwrap().iter().map(|r| r.id).collect();
    assert_eq!(again, [b]);
    let d = store.relay_request(replica, b"d", 9_000).await.unwrap();
    assert_eq!(store.expire_relayed(5_000).await.unwrap(), 1, "b, older than 5 000");
    let left: Vec<i64> =
        store.take_relayed(10, 9_001).await.unwrap().iter().map(|r| r.id).collect();
    assert_eq!(left, [d]);
}

/// A run's latest accuracy reports: every report of the newest model version with two or more
/// reports holding an accuracy; a newer version with one such report (and one without) is not it.
async fn the_latest_accuracy_reports_are_of_the_newest_version_two_devices_scored(store: SqlStore) {
    let (run, [d1, d2, _]) = run_with_open_round(&store).await;
    assert!(store.latest_accuracy_reports(run).await.unwrap().is_empty());
    for (version, d, metrics) in [
        (0, d1, r#"{"accuracy":0.5,"loss":1.0}"#),
        (0, d2, r#"{"accuracy":0.8,"loss":0.5}"#),
        (1, d1, r#"{"accuracy":0.6,"loss":0.9}"#),
        (1, d2, r#"{"top1_accuracy":0.9,"loss":0.4}"#),
    ] {
        store.insert_evaluation(run, d, ModelVersion(version), 10, metrics, 6_000).await.unwrap();
    }
    let latest = store.latest_accuracy_reports(run).await.unwrap();
    assert_eq!(latest.iter().map(|e| e.model_version).collect::<Vec<_>>(), [0, 0]);
    assert!(latest[0].metrics_json.contains("0.5") && latest[1].metrics_json.contains("0.8"));
}

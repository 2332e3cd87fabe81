//! Secure aggregation end to end: a real coordinator, devices running the SDK's SecAgg+ client
//! over HTTP, a real store — dropouts at every stage, a store audit, a coordinator killed
//! between stages, and real federated training through the masks.

use starling_core::codec;
use std::path::Path;

use futures_util::future::join_all;
use starling_client::participant::{Participant, ParticipantError};
use starling_client::protocol::FleetClient;
use starling_client::secure::{SecureError, SecureSession};
use starling_coordinator::store::SqlStore;
use starling_core::participation::Enrolment;
use starling_core::round::secure::Record;
use starling_core::secagg;
use starling_core::wire::{ErrorCode, SecAggInstruction, SecAggUpload, TaskAssignment};
use starling_core::{ModelVersion, RunId};
use starling_tests::*;

const PARAMS: usize = 1000;
const CLIP: f64 = 1.0;
const MAX_EXAMPLES: u64 = 100;

#[sqlx::test(migrations = false)]
async fn thirty_percent_dropout_on_postgres(
    _pool: sqlx::postgres::PgPoolOptions,
    opts: sqlx::postgres::PgConnectOptions,
) {
    thirty_percent_dropout(&pg_url(&opts)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_percent_dropout_on_sqlite() {
    let (_dir, url) = sqlite_db();
    thirty_percent_dropout(&url).await.unwrap();
}

#[sqlx::test(migrations = false)]
async fn a_coordinator_killed_between_stages_resumes_the_round(
    _pool: sqlx::postgres::PgPoolOptions,
    opts: sqlx::postgres::PgConnectOptions,
) {
    killed_between_stages(&pg_url(&opts)).await.unwrap();
}

/// A one-tensor plan of `PARAMS` values with secure aggregation over `n` devices.
fn secure_plan(
    n: u32,
    quorum: u32,
    reporting_secs: f64,
    neighbours: Option<u32>,
) -> serde_json::Value {
    let mut plan = PlanSpec {
        params: PARAMS as u64,
        cohort: n,
        over_selection: 1.0,
        quorum,
        selection_secs: reporting_secs.min(20.0),
        reporting_secs,
        rounds: 1,
    }
    .json();
    plan["secure_aggregation"] = serde_json::json!({
        "clip": CLIP, "max_examples": MAX_EXAMPLES, "stage_timeout_secs": 3.0,
        "neighbours": neighbours,
    });
    plan
}

/// The exact example-weighted mean applied to `global` (f64, rounded once).
fn expected_model(global: &[f32], devices: &[usize]) -> Vec<f32> {
    let contributions: Vec<_> = devices.iter().map(|&i| (delta(i, 0, PARAMS), weight(i))).collect();
    fedavg_expected(global, &contributions)
}

fn assert_close(got: &[f32], want: &[f32], tolerance: f32) {
    assert_eq!(got.len(), want.len());
    let worst = got.iter().zip(want).map(|(g, w)| (g - w).abs()).fold(0.0, f32::max);
    assert!(worst <= tolerance, "committed model is off by up to {worst}");
}

async fn advertise_all(
    devices: &[FleetClient],
    tasks: &[TaskAssignment],
    run: RunId,
) -> anyhow::Result<Vec<SecureSession>> {
    let joined = devices.iter().zip(tasks).map(|(d, t)| {
        let secure = t.secure_aggregation.expect("a secure run's task says so");
        SecureSession::advertise(d, run, (t.round_idx, t.model_version), secure)
    });
    Ok(join_all(joined).await.into_iter().collect::<Result<_, _>>()?)
}

/// 40 devices; 12 (30%) drop out mid-protocol: 4 after AdvertiseKeys, 4 after ShareKeys (while
/// "training"), 4 after sending their masked input. The round commits the weighted mean of the
/// 32 masked inputs, and at no point does the store hold an unmasked update.
async fn thirty_percent_dropout(db: &str) -> anyhow::Result<()> {
    const N: usize = 40;
    let c = start_in_process(db).await?;
    let devices = enroll(&c.url, &c.admin, N).await?;
    // 32 neighbours of 39: whichever 12 drop, each secret keeps ≥ 20 holders (t = 17) — a
    // SecAgg+ graph, not the complete one.
    let run = RunId(c.admin.create_run(&secure_plan(N as u32, 20, 8.0, Some(32))).await?.id);
    wait_round_open(&c.admin, run, 0).await?;
    let tasks = expect_tasks(&devices).await?;
    let global = model_values(&devices[0], &tasks[0].model_hash, &tasks[0].schema).await?;
    let secure = tasks[0].secure_aggregation.expect("secure task");
    assert_eq!((secure.config.n, secure.config.k, secure.config.t), (40, 32, 17));

    // A plain upload is refused: the coordinator takes masked inputs only.
    let plain = devices[0]
        .upload(run, tasks[0].round_idx, &upload_request(&tasks[0], &delta(0, 0, PARAMS), 10))
        .await;
    assert_eq!(api_code(plain), Some(ErrorCode::Conflict));

    let mut sessions = advertise_all(&devices, &tasks, run).await?;
    // Devices 0..4 vanish after advertising; the rest seal their shares.
    let shared = sessions[4..].iter_mut().zip(&devices[4..]).map(|(s, d)| s.share_keys(d));
    join_all(shared).await.into_iter().collect::<Result<Vec<_>, _>>()?;
    // Devices 4..8 vanish while training; the rest send masked inputs.
    // Each also evaluated the round's model on held-out examples (every fourth has none).
    let evaluation = |i: usize| {
        (!i.is_multiple_of(4)).then(|| secagg::EvaluationInput {
            examples: 10 + i as u64,
            accuracy: (i % 10) as f64 / 10.0,
            loss: 0.5 + i as f64 / 40.0,
        })
    };
    let masked = (8..N).map(|i| (i, delta(i, 0, PARAMS), weight(i)));
    let sent = sessions[8..].iter_mut().zip(&devices[8..]).zip(masked).map(
        |((s, d), (i, delta, w))| async move {
            s.send_masked(d, ModelVersion(0), &delta, w, evaluation(i)).await
        },
    );
    join_all(sent).await.into_iter().collect::<Result<Vec<_>, _>>()?;
    // A device's plain evaluation report is refused in a secure run: it would leak it.
    let leak = starling_core::wire::EvaluationReport {
        model_version: ModelVersion(0),
        example_count: 10,
        metrics: [("accuracy".to_owned(), 0.5)].into(),
    };
    assert_eq!(api_code(devices[9].evaluate(run, &leak).await), Some(ErrorCode::InvalidField));

    // The store audit, with every masked input in: secure-aggregation records only, and no
    // masked vector resembles any device's quantized input or contains its raw delta.
    let store = SqlStore::connect(db, false).await?;
    let payloads = store.stored_payloads(run).await?;
    let quantizer = secure.quantizer();
    let plaintexts: Vec<Vec<u32>> = (8..N)
        .map(|i| secagg::encode_weighted(&quantizer, &delta(i, 0, PARAMS), weight(i), MAX_EXAMPLES))
        .collect();
    let mut masked_inputs = 0;
    for payload in &payloads {
        let record: Record = codec::decode(payload).map_err(|e| {
            anyhow::anyhow!("a stored payload is not a secure-aggregation record: {e}")
        })?;
        for i in 8..N {
            let raw: Vec<u8> =
                delta(i, 0, PARAMS)[..16].iter().flat_map(|v| v.to_le_bytes()).collect();
            assert!(
                !payload.windows(raw.len()).any(|w| w == raw),
                "device {i}'s raw delta is stored"
            );
        }
        if let Record::Message { message: SecAggUpload::MaskedInput { masked, .. }, .. } = record {
            masked_inputs += 1;
            let y: Vec<u32> =
                masked.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
            for x in &plaintexts {
                let equal = y.iter().zip(x).filter(|(a, b)| a == b).count();
                assert!(equal < 5, "a stored masked input matches a plaintext in {equal} places");
            }
        }
    }
    assert_eq!(masked_inputs, N - 8);

    // Devices 8..12 vanish before unmasking; the others answer. The ones that left earlier are
    // told they are out.
    let unmasked = sessions[12..].iter_mut().zip(&devices[12..]).map(|(s, d)| s.unmask(d));
    join_all(unmasked).await.into_iter().collect::<Result<Vec<_>, _>>()?;
    let hash = wait_model(&c.admin, run, 1).await?;
    let committed = model_values(&devices[0], &hash, &tasks[0].schema).await?;
    let contributors: Vec<usize> = (8..N).collect();
    // Quantization: 26 bits over ±1, so ~1e-7 per weighted value; f32 rounding dominates.
    assert_close(&committed, &expected_model(&global, &contributors), 2e-6);
    let round = &c.admin.rounds(run).await?[0];
    assert_eq!(
        (
            round.state.as_str(),
            round.n_selected.unwrap(),
            round.n_reported.unwrap(),
            round.n_dropped
        ),
        ("committed", 40, 32, Some(8))
    );
    assert_eq!(store.secagg_record_count(run).await?, 0, "records outlive their round");
    // The survivors' evaluations of model 0, pooled through the same sum: the
    // coordinator holds only the cohort's means.
    let (mut examples, mut correct, mut loss) = (0.0, 0.0, 0.0);
    for e in contributors.iter().filter_map(|&i| evaluation(i)) {
        examples += e.examples as f64;
        correct += e.examples as f64 * e.accuracy;
        loss += e.examples as f64 * e.loss;
    }
    let model0 = &c.admin.models(run).await?[0];
    assert_eq!(model0.n_evaluations, 32, "pooled over the 32 survivors");
    assert!((model0.evaluation["accuracy"] - correct / examples).abs() < 1e-4, "{model0:?}");
    assert!((model0.evaluation["loss"] - loss / examples).abs() < 1e-3, "{model0:?}");
    // The run finished (one round): a late poll hears the round is over.
    let late = devices[0].secagg_instruction(run, tasks[0].round_idx).await;
    assert!(matches!(late, Ok(SecAggInstruction::Excluded { .. }) | Err(_)), "{late:?}");
    c.running.shutdown().await?;
    Ok(())
}

/// The coordinator is SIGKILLed after ShareKeys closed and half the masked inputs are durable;
/// a new process replays the round's records and the devices carry on to the exact mean.
async fn killed_between_stages(db: &str) -> anyhow::Result<()> {
    const N: usize = 10;
    let bin = Path::new(env!("CARGO_BIN_EXE_coordinator_under_test"));
    let mut coordinator = RestartableCoordinator::spawn(bin, db).await?;
    let admin = coordinator.admin.clone();
    let devices = enroll(coordinator.url(), &admin, N).await?;
    let run = RunId(admin.create_run(&secure_plan(N as u32, 8, 30.0, None)).await?.id);
    wait_round_open(&admin, run, 0).await?;
    let tasks = expect_tasks(&devices).await?;
    let global = model_values(&devices[0], &tasks[0].model_hash, &tasks[0].schema).await?;
    let mut sessions = advertise_all(&devices, &tasks, run).await?;
    let shared = sessions.iter_mut().zip(&devices).map(|(s, d)| s.share_keys(d));
    join_all(shared).await.into_iter().collect::<Result<Vec<_>, _>>()?;
    let (first, second) = sessions.split_at_mut(N / 2);
    for (i, s) in first.iter_mut().enumerate() {
        s.send_masked(&devices[i], ModelVersion(0), &delta(i, 0, PARAMS), weight(i), None).await?;
    }

    coordinator.kill()?;
    let log_text = std::fs::read_to_string(coordinator.log())?;
    coordinator.respawn().await?;

    for (j, s) in second.iter_mut().enumerate() {
        let i = N / 2 + j;
        s.send_masked(&devices[i], ModelVersion(0), &delta(i, 0, PARAMS), weight(i), None).await?;
    }
    let unmasked = sessions.iter_mut().zip(&devices).map(|(s, d)| s.unmask(d));
    join_all(unmasked).await.into_iter().collect::<Result<Vec<_>, _>>()?;
    let hash = wait_model(&admin, run, 1).await?;
    let committed = model_values(&devices[0], &hash, &tasks[0].schema).await?;
    assert_close(&committed, &expected_model(&global, &(0..N).collect::<Vec<_>>()), 2e-6);
    let round = &admin.rounds(run).await?[0];
    assert_eq!((round.n_reported.unwrap(), round.n_dropped), (10, Some(0)));
    assert!(!log_text.contains("panicked"), "the first process panicked:\n{log_text}");
    drop(coordinator);
    Ok(())
}

/// A secure round served entirely by a replica: every device enrolls, checks in, advertises,
/// shares, sends its masked input and unmasks through a coordinator that does not lead, which
/// relays each message and poll to the leader; the round commits the exact mean, as through
/// the leader.
#[sqlx::test(migrations = false)]
async fn a_secure_round_through_a_replica_commits_the_exact_mean(
    _pool: sqlx::postgres::PgPoolOptions,
    opts: sqlx::postgres::PgConnectOptions,
) {
    const N: usize = 6;
    let url = pg_url(&opts);
    let bin = Path::new(env!("CARGO_BIN_EXE_coordinator_under_test"));
    let logs = tempfile::tempdir().unwrap();
    let leader =
        ChildCoordinator::spawn(bin, &url, free_addr(), &logs.path().join("a.log")).await.unwrap();
    let replica =
        ChildCoordinator::spawn_standby(bin, &url, free_addr(), &logs.path().join("b.log"))
            .await
            .unwrap();
    let admin = starling_client::protocol::AdminClient::new(&leader.url, OPERATOR_TOKEN);
    let devices = enroll(&replica.url, &admin, N).await.unwrap();
    let plan = secure_plan(N as u32, N as u32, 30.0, Some(4));
    let run = RunId(admin.create_run(&plan).await.unwrap().id);
    wait_round_open(&admin, run, 0).await.unwrap();
    let tasks = expect_tasks(&devices).await.unwrap();
    let global = model_values(&devices[0], &tasks[0].model_hash, &tasks[0].schema).await.unwrap();
    let mut sessions = advertise_all(&devices, &tasks, run).await.unwrap();
    let shared = sessions.iter_mut().zip(&devices).map(|(s, d)| s.share_keys(d));
    join_all(shared).await.into_iter().collect::<Result<Vec<_>, _>>().unwrap();
    for (i, s) in sessions.iter_mut().enumerate() {
        let values = delta(i, 0, PARAMS);
        s.send_masked(&devices[i], ModelVersion(0), &values, weight(i), None).await.unwrap();
    }
    let unmasked = sessions.iter_mut().zip(&devices).map(|(s, d)| s.unmask(d));
    join_all(unmasked).await.into_iter().collect::<Result<Vec<_>, _>>().unwrap();
    let hash = wait_model(&admin, run, 1).await.unwrap();
    let committed = model_values(&devices[0], &hash, &tasks[0].schema).await.unwrap();
    assert_close(&committed, &expected_model(&global, &(0..N).collect::<Vec<_>>()), 2e-6);
    let round = &admin.rounds(run).await.unwrap()[0];
    assert_eq!((round.n_reported, round.n_dropped), (Some(N as i64), Some(0)));
}

/// Garbage, a message for the wrong stage, a conflicting resend and a masked input of the wrong
/// length are refused; only the last excludes its sender, and the others are unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_messages_exclude_only_their_sender() -> anyhow::Result<()> {
    const N: usize = 6;
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await?;
    let devices = enroll(&c.url, &c.admin, N).await?;
    let run = RunId(c.admin.create_run(&secure_plan(N as u32, 4, 30.0, None)).await?.id);
    wait_round_open(&c.admin, run, 0).await?;
    let tasks = expect_tasks(&devices).await?;
    let round = tasks[0].round_idx;
    let global = model_values(&devices[0], &tasks[0].model_hash, &tasks[0].schema).await?;
    // Not CBOR at all; a masked input during AdvertiseKeys (wrong stage, not excluded).
    let (status, _) = devices[0]
        .post_raw(
            &format!("/v1/runs/{run}/rounds/{round}/secagg"),
            b"\xff\x00".to_vec(),
            "application/cbor",
        )
        .await?;
    assert_eq!(status, 400);
    let early = SecAggUpload::MaskedInput {
        model_version: ModelVersion(0),
        masked: vec![0; 4],
        accusations: Vec::new(),
    };
    assert_eq!(
        api_code(devices[0].secagg_send(run, round, &early).await),
        Some(ErrorCode::Conflict)
    );
    let mut sessions = advertise_all(&devices, &tasks, run).await?;
    let task5 = tasks[5].secure_aggregation.expect("a secure task");
    // Device 5 sends a second, different set of keys: refused (its first keys stay in), and it
    // then drops out before sharing.
    let other = secagg::AdvertiseKeys {
        identity: devices[5].identity().expect("enrolled with an identity").public(),
        cipher_pk: [7; 32],
        mask_pk: [8; 32],
        seed_commitment: [9; 32],
        signature: secagg::Signature { r: [1; 32], s: [2; 32] },
        certificate: None,
    };
    let twice = devices[5].secagg_send(run, round, &SecAggUpload::AdvertiseKeys(other)).await;
    assert_eq!(api_code(twice), Some(ErrorCode::InvalidField));
    // Keys signed by any identity but the one the device enrolled with are refused at the door.
    let stranger = secagg::DeviceIdentity::from_secret([3; 32]);
    let (_, foreign) = secagg::Client::new(task5.index, task5.config, stranger, [4; 96])?;
    let refused = devices[5].secagg_send(run, round, &SecAggUpload::AdvertiseKeys(foreign)).await;
    match refused {
        Err(starling_client::protocol::ClientError::Api { body, .. }) => {
            assert_eq!(body.code, ErrorCode::InvalidField);
            assert!(body.message.contains("another identity"), "{}", body.message);
        }
        other => panic!("keys of a foreign identity were not refused: {other:?}"),
    }
    let shared = sessions[..5].iter_mut().zip(&devices).map(|(s, d)| s.share_keys(d));
    join_all(shared).await.into_iter().collect::<Result<Vec<_>, _>>()?;
    // Device 4 sends a masked input of the wrong length: excluded, and told so afterwards.
    let task = tasks[4].secure_aggregation.unwrap();
    let short = SecAggUpload::MaskedInput {
        model_version: ModelVersion(0),
        masked: vec![1; task.config.len * 4 - 4],
        accusations: Vec::new(),
    };
    // Wait (at the pace the coordinator asks for) until the stage is MaskedInput, then send it.
    let told = next_instruction(&devices[4], run, round).await?;
    anyhow::ensure!(
        matches!(told, SecAggInstruction::MaskedInput(_)),
        "device 4 was told {told:?}"
    );
    assert_eq!(
        api_code(devices[4].secagg_send(run, round, &short).await),
        Some(ErrorCode::InvalidField)
    );
    assert!(matches!(
        devices[4].secagg_instruction(run, round).await?,
        SecAggInstruction::Excluded { .. }
    ));
    let sent = sessions[..4].iter_mut().zip(&devices).enumerate().map(|(i, (s, d))| async move {
        s.send_masked(d, ModelVersion(0), &delta(i, 0, PARAMS), weight(i), None).await
    });
    join_all(sent).await.into_iter().collect::<Result<Vec<_>, _>>()?;
    let unmasked = sessions[..4].iter_mut().zip(&devices).map(|(s, d)| s.unmask(d));
    join_all(unmasked).await.into_iter().collect::<Result<Vec<_>, _>>()?;
    let hash = wait_model(&c.admin, run, 1).await?;
    let committed = model_values(&devices[0], &hash, &tasks[0].schema).await?;
    assert_close(&committed, &expected_model(&global, &[0, 1, 2, 3]), 2e-6);
    // Device 5, which dropped after AdvertiseKeys, learns it is out when it tries to continue.
    let excluded = sessions[5].share_keys(&devices[5]).await;
    assert!(
        matches!(excluded, Err(SecureError::Excluded(_)) | Err(SecureError::Protocol(_))),
        "{excluded:?}"
    );
    c.running.shutdown().await?;
    Ok(())
}

/// Real federated training through SecAgg+: the SDK's participants train an MLP on the
/// digits dataset and the coordinator only ever unmasks the cohort's sums.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn federated_digits_train_through_secure_aggregation() {
    use starling_client::simulate::{SimulationConfig, simulate};
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let config = SimulationConfig { secure: true, ..digits_simulation(&c.url, 12, 8, 6, 11) };
    let results = simulate(config, |r| {
        eprintln!("secure model {}: test accuracy {:.3}", r.version, r.test_accuracy)
    })
    .await
    .unwrap()
    .rounds;
    assert_eq!(results.len(), 6);
    let accuracy: Vec<f64> = results.iter().map(|r| r.test_accuracy).collect();
    assert!(accuracy[5] >= 0.85, "accuracy curve: {accuracy:?}");
    let rounds = c.admin.rounds(RunId(1)).await.unwrap();
    assert!(rounds.iter().filter(|r| r.state == "committed").count() == 6);
    c.running.shutdown().await.unwrap();
}

/// Waits (at the pace the coordinator asks for) until `device` is told something other than
/// to wait.
async fn next_instruction(
    device: &FleetClient,
    run: RunId,
    round: starling_core::RoundIdx,
) -> anyhow::Result<SecAggInstruction> {
    loop {
        match device.secagg_instruction(run, round).await? {
            SecAggInstruction::Wait { retry_after_ms } => {
                tokio::time::sleep(std::time::Duration::from_millis(retry_after_ms.into())).await
            }
            other => return Ok(other),
        }
    }
}

/// What a device running core's protocol client itself does wrong in [`round_of_core_clients`].
#[derive(Clone, Copy)]
enum Misbehaviour {
    /// Device 0 garbles its sealed shares to its first neighbour.
    GarbledShare,
    /// Device 1 accuses device 2 of shares that did not open, with made-up evidence.
    UnprovenAccusation,
}

/// One secure round of `n` devices over HTTP, each running core's protocol client itself so
/// that one can misbehave; returns the devices told they are excluded, the committed model's
/// distance from the mean of `expected` and the round's reported count.
async fn round_of_core_clients(
    n: usize,
    misbehaviour: Misbehaviour,
    expected: &[usize],
) -> anyhow::Result<(Vec<usize>, i64)> {
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await?;
    let devices = enroll(&c.url, &c.admin, n).await?;
    let run = RunId(c.admin.create_run(&secure_plan(n as u32, 3, 30.0, None)).await?.id);
    wait_round_open(&c.admin, run, 0).await?;
    let tasks = expect_tasks(&devices).await?;
    let round = tasks[0].round_idx;
    let global = model_values(&devices[0], &tasks[0].model_hash, &tasks[0].schema).await?;
    let secure: Vec<_> = tasks.iter().map(|t| t.secure_aggregation.unwrap()).collect();
    let mut clients = vec![];
    for (i, s) in secure.iter().enumerate() {
        // Test-only randomness, distinct per device and per secret.
        let randomness = std::array::from_fn(|j| (j as u8).wrapping_mul(7) ^ (i as u8 * 31 + 1));
        let identity = devices[i].identity().cloned().expect("enrolled with an identity");
        let (client, keys) = secagg::Client::new(s.index, s.config, identity, randomness)?;
        devices[i].secagg_send(run, round, &SecAggUpload::AdvertiseKeys(keys)).await?;
        clients.push(client);
    }
    for i in 0..n {
        let SecAggInstruction::ShareKeys(keys) = next_instruction(&devices[i], run, round).await?
        else {
            anyhow::bail!("device {i} was not asked to share keys");
        };
        let mut sealed = clients[i].share_keys(keys)?;
        // A device that seals garbage signs what it sends.
        if i == 0 && matches!(misbehaviour, Misbehaviour::GarbledShare) {
            sealed[0].ciphertext[0] ^= 0xff;
            let identity = devices[i].identity().expect("enrolled with an identity");
            sealed[0].sign(identity, &secure[i].config.session);
        }
        devices[i].secagg_send(run, round, &SecAggUpload::ShareKeys(sealed)).await?;
    }
    for i in 0..n {
        let SecAggInstruction::MaskedInput(request) =
            next_instruction(&devices[i], run, round).await?
        else {
            anyhow::bail!("device {i} was not asked for its masked input");
        };
        let (q, cap) = (secure[i].quantizer(), secure[i].max_examples);
        let mut input = secagg::encode_weighted(&q, &delta(i, 0, PARAMS), weight(i), cap);
        if secure[i].config.len == input.len() + secagg::EVALUATION_ENTRIES {
            secagg::append_evaluation(&q, &mut input, None, cap, secagg::SECURE_LOSS_CAP);
        }
        let masked = clients[i].masked_input(request, &input)?;
        let mut accusations = clients[i].accusations();
        if i == 1 && matches!(misbehaviour, Misbehaviour::UnprovenAccusation) {
            // A point that is some other channel's, and a proof of nothing.
            let stranger = secagg::DeviceIdentity::from_secret([9; 32]);
            let (_, keys) =
                secagg::Client::new(secure[1].index, secure[1].config, stranger, [9; 96])?;
            let proof = secagg::ChannelProof { challenge: [0; 32], response: [0; 32] };
            accusations.push(secagg::Accusation {
                accused: secure[2].index,
                shared: keys.cipher_pk,
                proof,
            });
        }
        let upload = SecAggUpload::MaskedInput {
            model_version: ModelVersion(0),
            masked: masked.iter().flat_map(|v| v.to_le_bytes()).collect(),
            accusations,
        };
        let sent = devices[i].secagg_send(run, round, &upload).await;
        if i == 1 && matches!(misbehaviour, Misbehaviour::UnprovenAccusation) {
            assert_eq!(api_code(sent), Some(ErrorCode::InvalidField), "the accusation is refused");
        } else {
            sent?;
        }
    }
    let mut excluded = vec![];
    for i in 0..n {
        match next_instruction(&devices[i], run, round).await? {
            SecAggInstruction::SignSurvivors(request) => {
                let signature = clients[i].sign_survivors(request)?;
                devices[i].secagg_send(run, round, &SecAggUpload::SignSurvivors(signature)).await?;
            }
            SecAggInstruction::Excluded { reason } => {
                eprintln!("device {i} excluded: {reason}");
                excluded.push(i);
            }
            other => anyhow::bail!("device {i} was told {other:?}"),
        }
    }
    for i in (0..n).filter(|i| !excluded.contains(i)) {
        let SecAggInstruction::Unmask(request) = next_instruction(&devices[i], run, round).await?
        else {
            anyhow::bail!("device {i} was not asked to unmask");
        };
        let response = clients[i].unmask(request)?;
        devices[i].secagg_send(run, round, &SecAggUpload::Unmask(response)).await?;
    }
    let hash = wait_model(&c.admin, run, 1).await?;
    let committed = model_values(&devices[0], &hash, &tasks[0].schema).await?;
    assert_close(&committed, &expected_model(&global, expected), 2e-6);
    let reported = c.admin.rounds(run).await?[0].n_reported.unwrap();
    c.running.shutdown().await?;
    Ok((excluded, reported))
}

/// The coordinator adds masked inputs into one running sum as they arrive. A device
/// whose sealed share its neighbour cannot open is in that sum when the neighbour reports it
/// (with the proven channel point under which the share does not open), so at commit its masked
/// vector is read back from the round's records and taken out; the round commits the others'
/// mean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_whose_share_does_not_open_is_taken_out_of_the_running_sum() -> anyhow::Result<()>
{
    let (excluded, reported) =
        round_of_core_clients(5, Misbehaviour::GarbledShare, &[1, 2, 3, 4]).await?;
    assert_eq!((excluded, reported), (vec![0], 4));
    Ok(())
}

/// A device cannot take a neighbour out of the sum by saying its shares did not open: an
/// accusation whose evidence does not check out is refused, the accuser is left out, and the
/// accused's update is in the committed mean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unproven_accusation_leaves_out_the_accuser_not_the_accused() -> anyhow::Result<()> {
    let (excluded, reported) =
        round_of_core_clients(6, Misbehaviour::UnprovenAccusation, &[0, 2, 3, 4, 5]).await?;
    assert_eq!((excluded, reported), (vec![1], 5));
    Ok(())
}

/// Devices with identity keys the operator's enrolment authority certified, pinning that
/// authority: `n` of them, enrolled with `token` at `url`.
async fn certified_devices(
    url: &str,
    token: &str,
    authority: &secagg::EnrolmentAuthority,
    n: usize,
) -> anyhow::Result<Vec<FleetClient>> {
    let mut devices = Vec::with_capacity(n);
    for _ in 0..n {
        let mut d = FleetClient::new(url);
        let identity = starling_client::protocol::new_identity();
        d.set_enrolment(Enrolment {
            authority: Some(authority.public()),
            certificate: Some(authority.certify(&identity.public())),
        });
        d.set_identity(Some(identity));
        d.enroll(token).await?;
        devices.push(d);
    }
    Ok(devices)
}

/// A coordinator given the operator's enrolment authority turns away identity keys the
/// authority did not certify (none, or another authority's certificate) with 403
/// `identity_not_certified`; devices that pin the authority and hold its certificates complete
/// a SecAgg+ round through it to the exact mean, each having checked its neighbourhood against
/// the public graph and its neighbours' certificates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_pinning_the_enrolment_authority_complete_a_round_with_certified_neighbours()
-> anyhow::Result<()> {
    const N: usize = 8;
    let authority = secagg::EnrolmentAuthority::from_secret([42; 32]);
    let (_dir, db) = sqlite_db();
    let c = start_in_process_configured(&db, &Default::default(), |config| {
        config.enrolment_authority = Some(authority.public());
    })
    .await?;
    let token = c.admin.enrollment_token(N as i64 + 3).await?;
    let mut uncertified = FleetClient::new(&c.url);
    assert_eq!(api_code(uncertified.enroll(&token).await), Some(ErrorCode::IdentityNotCertified));
    let stranger = secagg::EnrolmentAuthority::from_secret([43; 32]);
    let mut elsewhere = certified_devices(&c.url, &token, &stranger, 1).await;
    assert!(elsewhere.is_err(), "another authority's certificate");
    let refused = elsewhere.as_mut().map(|_| ()).unwrap_err();
    assert!(refused.to_string().contains("enrolment authority"), "{refused}");

    // The SDK's participant makes its identity key before enrolling, so the operator can
    // certify it; refuses a certificate of another key; and registers the certified key.
    let nothing =
        starling_client::examples::Examples::new(starling_core::model_spec::InputSpec::Features {
            size: 1,
        });
    let device = starling_client::Device::flex().autodiff();
    let mut p = Participant::new(&c.url, "default", nothing.clone(), nothing, device);
    let key = p.identity_key();
    assert_eq!(p.identity_key(), key, "made once and kept");
    let pin = |certificate| Enrolment { authority: Some(authority.public()), certificate };
    let wrong =
        pin(Some(authority.certify(&secagg::DeviceIdentity::from_secret([9; 32]).public())));
    assert!(matches!(p.set_enrolment(wrong), Err(ParticipantError::CertificateMismatch)));
    p.set_enrolment(pin(Some(authority.certify(&key))))?;
    p.enroll(&token).await?;
    assert_eq!(p.state().enrolment, pin(Some(authority.certify(&key))));

    let devices = certified_devices(&c.url, &token, &authority, N).await?;
    let run = RunId(c.admin.create_run(&secure_plan(N as u32, N as u32, 8.0, Some(4))).await?.id);
    wait_round_open(&c.admin, run, 0).await?;
    let tasks = expect_tasks(&devices).await?;
    let global = model_values(&devices[0], &tasks[0].model_hash, &tasks[0].schema).await?;
    let mut sessions = advertise_all(&devices, &tasks, run).await?;
    let shared = sessions.iter_mut().zip(&devices).map(|(s, d)| s.share_keys(d));
    join_all(shared).await.into_iter().collect::<Result<Vec<_>, _>>()?;
    let sent = sessions.iter_mut().zip(&devices).enumerate().map(|(i, (s, d))| async move {
        s.send_masked(d, ModelVersion(0), &delta(i, 0, PARAMS), weight(i), None).await
    });
    join_all(sent).await.into_iter().collect::<Result<Vec<_>, _>>()?;
    let unmasked = sessions.iter_mut().zip(&devices).map(|(s, d)| s.unmask(d));
    join_all(unmasked).await.into_iter().collect::<Result<Vec<_>, _>>()?;
    let hash = wait_model(&c.admin, run, 1).await?;
    let committed = model_values(&devices[0], &hash, &tasks[0].schema).await?;
    assert_close(&committed, &expected_model(&global, &(0..N).collect::<Vec<_>>()), 2e-6);
    c.running.shutdown().await?;
    Ok(())
}

/// A coordinator that enrolls a member of its own (here: one that checks no certificates, and
/// a device with none) cannot seat it beside devices that pin the authority: each of them
/// refuses the neighbourhood before sharing anything, naming the uncertified neighbour, and the
/// round fails without a sum.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_the_authority_did_not_certify_gets_no_shares_from_pinning_devices()
-> anyhow::Result<()> {
    const N: usize = 5;
    let authority = secagg::EnrolmentAuthority::from_secret([44; 32]);
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await?;
    let token = c.admin.enrollment_token(N as i64 + 1).await?;
    let mut devices = certified_devices(&c.url, &token, &authority, N).await?;
    let mut sybil = FleetClient::new(&c.url);
    sybil.enroll(&token).await?;
    devices.push(sybil);
    // The complete graph: the sybil is everyone's neighbour.
    let n = devices.len() as u32;
    let run = RunId(c.admin.create_run(&secure_plan(n, n, 8.0, None)).await?.id);
    wait_round_open(&c.admin, run, 0).await?;
    let tasks = expect_tasks(&devices).await?;
    let mut sessions = advertise_all(&devices, &tasks, run).await?;
    let shared = sessions.iter_mut().zip(&devices).map(|(s, d)| s.share_keys(d));
    let results = join_all(shared).await;
    for (i, result) in results[..N].iter().enumerate() {
        let err = result.as_ref().expect_err("a pinning device shares with no uncertified member");
        assert!(
            err.to_string().contains("no certificate from the pinned enrolment authority"),
            "device {i}: {err}"
        );
    }
    let state = wait_for("the round to fail", std::time::Duration::from_secs(30), || async {
        let rounds = c.admin.rounds(run).await?;
        Ok(rounds.into_iter().next().map(|r| r.state).filter(|s| s != "open"))
    })
    .await?;
    assert_eq!(state, "failed");
    c.running.shutdown().await?;
    Ok(())
}

//! Differential privacy: the accountant against Google's `dp-accounting`, and DP-FedAvg runs
//! that report the ε they spent and stop at their budget.

use std::collections::BTreeMap;
use std::process::Command;

use starling_core::privacy::{RdpAccountant, Sampling};
use starling_core::{RoundIdx, RunId};
use starling_tests::*;

/// The grid: sampling rate, noise multiplier, steps, δ.
const GRID: &[(f64, f64, u64, f64)] = &[
    (0.001, 0.5, 1, 1e-5),
    (0.01, 1.0, 100, 1e-5),
    (0.01, 1.1, 6000, 1e-5),
    (0.02, 0.8, 1000, 1e-6),
    (0.05, 2.0, 50, 1e-5),
    (0.1, 1.0, 200, 1e-5),
    (0.1, 4.0, 1000, 1e-8),
    (0.25, 1.5, 30, 1e-5),
    (0.5, 3.0, 10, 1e-3),
    (1.0, 1.0, 1, 1e-5),
    (1.0, 10.0, 500, 1e-5),
    (0.004, 0.7, 10_000, 1e-5),
];

/// Google's reference: the RDP accountant of `dp-accounting`, over its default orders (the same
/// as ours), composing a Poisson-sampled Gaussian event (add/remove adjacency) or, for a
/// fixed-size cohort of m of n, a sampled-without-replacement one (replace-one adjacency).
const REFERENCE: &str = r#"
import json, sys
import dp_accounting
grid = json.loads(sys.argv[1])
out = []
for kind, q, z, steps, delta in grid:
    if kind == "poisson":
        acc = dp_accounting.rdp.RdpAccountant()
        event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    elif kind == "pld":
        acc = dp_accounting.pld.PLDAccountant()
        event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    else:
        n = 100000
        acc = dp_accounting.rdp.RdpAccountant(
            neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
        event = dp_accounting.SampledWithoutReplacementDpEvent(
            n, round(q * n), dp_accounting.GaussianDpEvent(z))
    acc.compose(event, int(steps))
    out.append(acc.get_epsilon(delta))
print(json.dumps(out))
"#;

/// ε of `kind` ("poisson", "without_replacement" or "pld") over `grid`, by `dp-accounting`; `None`
/// (a recorded skip) without it.
fn reference(kind: &str, grid: &[(f64, f64, u64, f64)]) -> Option<Vec<f64>> {
    let python = python_with(&["dp_accounting"])?;
    let grid: Vec<(&str, f64, f64, u64, f64)> =
        grid.iter().map(|&(q, z, steps, delta)| (kind, q, z, steps, delta)).collect();
    let output = Command::new(python)
        .args(["-c", REFERENCE, &serde_json::to_string(&grid).unwrap()])
        .output()
        .expect("running Python");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    Some(serde_json::from_slice(&output.stdout).expect("a list of ε"))
}

/// Ours (`ours(q, z, steps, δ)`) against the reference on `grid`, to relative `tolerance`.
fn agrees(
    kind: &str,
    grid: &[(f64, f64, u64, f64)],
    tolerance: f64,
    ours: impl Fn(f64, f64, u64, f64) -> f64,
) {
    let Some(reference) = reference(kind, grid) else { return };
    let mut worst = 0.0f64;
    for (&(q, z, steps, delta), want) in grid.iter().zip(reference) {
        let got = ours(q, z, steps, delta);
        let rel = (got - want).abs() / want.abs().max(1e-12);
        eprintln!(
            "{kind} q={q} z={z} steps={steps} δ={delta}: ours {got:.6}, dp-accounting {want:.6}, rel {rel:.2e}"
        );
        assert!(
            rel <= tolerance,
            "{kind} q={q} z={z} steps={steps} δ={delta}: ε {got} vs dp-accounting {want}"
        );
        worst = worst.max(rel);
    }
    eprintln!("{kind}: worst relative difference {worst:.2e}");
}

/// The RDP accountants use the same orders and closed forms as the reference: they agree to
/// rounding (worst seen about 1e-13), so a 1e-10 tolerance catches any real change.
fn rdp(accountant: fn(f64, f64) -> RdpAccountant) -> impl Fn(f64, f64, u64, f64) -> f64 {
    move |q, z, steps, delta| accountant(q, z).epsilon(steps, delta)
}

#[test]
fn the_poisson_accountant_agrees_with_google_dp_accounting_to_1e_10() {
    agrees("poisson", GRID, 1e-10, rdp(RdpAccountant::new));
}

/// The PLD accountant discretizes as the reference does (Connect-the-Dots on a 1e-4 grid)
/// and composes by its own FFT, trimming tails its own way: they agree to 1e-9 to 1e-8, and
/// to 3e-6 at δ = 1e-8 (ours the larger), so 1e-5 still catches a wrong discretization.
#[test]
fn the_pld_accountant_agrees_with_google_dp_accounting_to_1e_5() {
    let grid: Vec<(f64, f64, u64, f64)> =
        GRID.iter().copied().filter(|&(q, _, steps, _)| q < 1.0 && steps <= 6000).collect();
    agrees("pld", &grid, 1e-5, |q, z, steps, delta| {
        starling_core::privacy::pld::epsilon(q, z, steps, delta, 1e-4).unwrap()
    });
}

#[test]
fn the_fixed_size_accountant_agrees_with_google_dp_accounting_to_1e_10() {
    // Every rate of the grid is m / 100 000 for a whole m; q = 1 is the Gaussian mechanism.
    let grid: Vec<(f64, f64, u64, f64)> = GRID
        .iter()
        .copied()
        .chain([(0.13, 3.0, 30, 1e-5), (0.1, 0.5, 30, 1e-5), (0.003, 2.0, 2000, 1e-6)])
        .collect();
    agrees("without_replacement", &grid, 1e-10, rdp(RdpAccountant::without_replacement));
}

/// Checks in, as a device does, until it is handed a task: a fixed-size DP draw answers only
/// once its selection window is over, and until then the device comes back when the
/// coordinator says. Fails after 30 s.
async fn drawn_task(
    device: &starling_client::protocol::FleetClient,
) -> anyhow::Result<starling_core::wire::TaskAssignment> {
    use starling_core::wire::CheckInResponse;
    let checking_in = async {
        loop {
            match device.check_in("default").await? {
                CheckInResponse::Task(t) => return anyhow::Ok(t),
                CheckInResponse::ComeBackLater { retry_after_secs } => {
                    tokio::time::sleep(std::time::Duration::from_secs(retry_after_secs.into()))
                        .await
                }
            }
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(30), checking_in).await?
}

/// A device's own evaluation report to a DP run is refused, naming why.
async fn assert_own_evaluation_refused(
    device: &starling_client::protocol::FleetClient,
    run: RunId,
) {
    let report = starling_core::wire::EvaluationReport {
        model_version: starling_core::ModelVersion(1),
        example_count: 10,
        metrics: [("accuracy".to_owned(), 0.9)].into(),
    };
    let refused = device.evaluate(run, &report).await.unwrap_err().to_string();
    assert!(refused.contains("differentially private"), "{refused}");
}

/// What a DP round added beside the unweighted mean of its `uploads` clipped to `clip`: the
/// committed model `got` less the round's model `global` and that mean, per value.
fn dp_noise(global: &[f32], got: &[f32], uploads: &[Vec<f32>], clip: f64) -> Vec<f64> {
    let clipped: Vec<Vec<f32>> =
        uploads.iter().map(|u| starling_core::robust::clip_to_norm(u, clip)).collect();
    (0..global.len())
        .map(|j| {
            let mean = clipped.iter().map(|u| f64::from(u[j])).sum::<f64>() / uploads.len() as f64;
            f64::from(got[j]) - f64::from(global[j]) - mean
        })
        .collect()
}

/// A DP-FedAvg run over HTTP: its cohort is drawn from the devices measured in each selection
/// window (here all five of five: q = 1, accounted as such), each update is clipped and counts
/// once, the committed model is the clipped mean plus Gaussian noise of the stated scale, ε
/// after each round is the replace-one accountant's (run view and /metrics), nothing un-noised
/// (training metrics, evaluations, devices' example counts) is released, and the run stops when one more round would
/// pass its ε budget. A budget no round fits is refused with the figure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dp_run_adds_the_stated_noise_reports_epsilon_and_stops_at_its_budget() {
    const N: usize = 5;
    const PARAMS: usize = 2_000;
    let (z, clip, population, delta_dp) = (2.0, 0.5, N as u64, 1e-5);
    let accountant = Sampling::FixedSize.accountant(1.0, z);
    // Room for two rounds, not three.
    let budget = (accountant.epsilon(2, delta_dp) + accountant.epsilon(3, delta_dp)) / 2.0;
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let devices = enroll(&c.url, &c.admin, N).await.unwrap();
    let spec = PlanSpec { selection_secs: 1.0, ..PlanSpec::all_of(N, PARAMS, 5) };
    let mut plan = spec.json();
    let dp = serde_json::json!({
        "noise_multiplier": z, "clip_norm": clip, "population": population, "delta": delta_dp,
        "epsilon_budget": budget,
    });
    plan["strategy"] = serde_json::json!({"differential_privacy": dp});
    let created = c.admin.create_run(&plan).await.unwrap();
    let run = RunId(created.id);
    assert_eq!(created.total_rounds, 2, "the budget allows two of the five rounds");
    let privacy = created.privacy.expect("a DP run shows its privacy");
    assert_eq!((privacy.epsilon, privacy.rounds_allowed), (0.0, 2));
    assert_eq!(privacy.sampling_rate, 1.0);
    assert!(privacy.accounting.contains("replace-one"), "{}", privacy.accounting);

    let schema = spec.schema();
    let mut hash = c.admin.models(run).await.unwrap()[0].content_hash.clone();
    for round in 0..2i64 {
        let global = model_values(&devices[0], &hash, &schema).await.unwrap();
        wait_round_open(&c.admin, run, round).await.unwrap();
        let tasks =
            futures_util::future::try_join_all(devices.iter().map(drawn_task)).await.unwrap();
        assert!(tasks.iter().all(|t| t.withhold_metrics), "devices are told to send no metrics");
        let uploads: Vec<Vec<f32>> = (0..N).map(|i| delta(i, round, PARAMS)).collect();
        for ((d, t), (i, u)) in devices.iter().zip(&tasks).zip(uploads.iter().enumerate()) {
            // Weights differ, but DP counts every update once.
            d.upload(run, RoundIdx(round), &upload_request(t, u, weight(i))).await.unwrap();
        }
        hash = wait_model(&c.admin, run, round + 1).await.unwrap();
        let got = model_values(&devices[0], &hash, &schema).await.unwrap();
        let noise = dp_noise(&global, &got, &uploads, clip);
        let mean = noise.iter().sum::<f64>() / PARAMS as f64;
        let sd = (noise.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / PARAMS as f64).sqrt();
        let want = z * clip / N as f64;
        assert!((sd / want - 1.0).abs() < 0.1, "round {round}: noise sd {sd}, stated {want}");
        assert!(
            mean.abs() < 4.0 * want / (PARAMS as f64).sqrt(),
            "round {round}: noise mean {mean}"
        );
        let view = c.admin.run(run).await.unwrap();
        if view.rounds_committed == round + 1 {
            let eps = view.privacy.unwrap().epsilon;
            let expected = accountant.epsilon(round as u64 + 1, delta_dp);
            assert!(
                (eps - expected).abs() <= 1e-12 * expected,
                "round {round}: ε {eps} vs {expected}"
            );
        }
    }
    let view =
        wait_for("the budget to end the run", std::time::Duration::from_secs(30), || async {
            let view = c.admin.run(run).await?;
            Ok((view.status == "finished").then_some(view))
        })
        .await
        .unwrap();
    assert_eq!(view.rounds_committed, 2);
    // Nothing un-noised leaves the run: the uploads carried a loss each, and no round shows
    // one; a device's evaluation is refused, not stored.
    for r in c.admin.rounds(run).await.unwrap() {
        assert!(
            r.metrics.as_ref().is_none_or(|m| m.is_empty()),
            "round {}: {:?}",
            r.round_idx,
            r.metrics
        );
    }
    assert_own_evaluation_refused(&devices[0], run).await;
    for m in c.admin.models(run).await.unwrap() {
        assert_eq!(m.n_evaluations, 0, "model {}: no device's evaluation is shown", m.version);
    }
    // Nor any device's example count: the devices reported differing weights.
    for round in 0..2 {
        let record = c.admin.round_devices(run, round).await.unwrap();
        assert_eq!(record.len(), N, "round {round}: {record:?}");
        assert!(
            record.iter().all(|d| d.reported.as_deref() == Some("update")),
            "round {round}: {record:?}"
        );
        assert!(record.iter().all(|d| d.example_count.is_none()), "round {round}: {record:?}");
    }
    let spent = view.privacy.unwrap();
    assert!(spent.epsilon <= budget && spent.epsilon == accountant.epsilon(2, delta_dp));
    let metrics = reqwest::Client::new()
        .get(format!("{}/metrics", c.url))
        .bearer_auth(starling_tests::OPERATOR_TOKEN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let line = format!("starling_privacy_epsilon{{run=\"{}\"}} ", run.0);
    let exported: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix(&line))
        .unwrap_or_else(|| panic!("no {line} in /metrics"))
        .parse()
        .unwrap();
    assert_eq!(exported, spent.epsilon);

    // A budget that not even one round fits is refused, naming what one round costs.
    plan["strategy"]["differential_privacy"]["epsilon_budget"] = 0.01.into();
    let err = c.admin.create_run(&plan).await.unwrap_err().to_string();
    assert!(err.contains("epsilon_budget") && err.contains("one round already spends"), "{err}");
    c.running.shutdown().await.unwrap();
}

/// A DP run whose plan says `metrics: noised` releases its cohort's training loss and pooled
/// evaluation, each noised inside the accounted mechanism: devices are told to send their
/// evaluation with the update, the coordinator clips each device's block, the model's noise is
/// the update share `z_Δ = (z⁻² − (σ_m/2)⁻²)^(-1/2)` that is left (more than `z`), the ε is
/// still `z`'s, the released loss and accuracy are the cohort's within their stated noise,
/// and a device's own evaluation is still refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dp_run_that_noises_its_metrics_releases_them_inside_its_epsilon() {
    const N: usize = 40;
    const PARAMS: usize = 2_000;
    let (z, clip, sigma_m, loss_bound, delta_dp) = (0.5f64, 0.5, 2.0, 2.0, 1e-5);
    let z_update = (z.powi(-2) - (sigma_m / 2.0f64).powi(-2)).powf(-0.5);
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let devices = enroll(&c.url, &c.admin, N).await.unwrap();
    let spec = PlanSpec { selection_secs: 1.0, ..PlanSpec::all_of(N, PARAMS, 1) };
    let mut plan = spec.json();
    plan["strategy"] = serde_json::json!({"differential_privacy": {
        "noise_multiplier": z, "clip_norm": clip, "population": N, "delta": delta_dp,
        "metrics": {"noised": {"stddev": sigma_m, "loss_bound": loss_bound}},
    }});
    let run = RunId(c.admin.create_run(&plan).await.unwrap().id);
    let privacy = c.admin.run(run).await.unwrap().privacy.expect("a DP run shows its privacy");
    assert!(privacy.metrics.starts_with("noised"), "{}", privacy.metrics);

    let schema = spec.schema();
    let hash = c.admin.models(run).await.unwrap()[0].content_hash.clone();
    let global = model_values(&devices[0], &hash, &schema).await.unwrap();
    wait_round_open(&c.admin, run, 0).await.unwrap();
    let tasks = futures_util::future::try_join_all(devices.iter().map(drawn_task)).await.unwrap();
    assert!(
        tasks.iter().all(|t| t.evaluation_in_update && !t.withhold_metrics),
        "devices are told to send their metrics and evaluation with the update"
    );
    // Every device trained to loss 1.5 and evaluated at 80 % with loss 0.5, except one that
    // claims a loss of 1e9 and 500 % (its block is clipped, not trusted).
    let uploads: Vec<Vec<f32>> = (0..N).map(|i| delta(i, 0, PARAMS)).collect();
    for (i, ((d, t), u)) in devices.iter().zip(&tasks).zip(&uploads).enumerate() {
        let (loss, accuracy) = if i == 0 { (1e9, 5.0) } else { (1.5, 0.8) };
        let mut request = upload_request(t, u, weight(i));
        request.metrics = [
            ("loss".to_owned(), loss),
            ("eval_accuracy".to_owned(), accuracy),
            ("eval_loss".to_owned(), 0.5),
            ("secret".to_owned(), 42.0),
        ]
        .into();
        d.upload(run, RoundIdx(0), &request).await.unwrap();
    }
    let hash = wait_model(&c.admin, run, 1).await.unwrap();
    let got = model_values(&devices[0], &hash, &schema).await.unwrap();
    let noise = dp_noise(&global, &got, &uploads, clip);
    let sd = (noise.iter().map(|x| x * x).sum::<f64>() / PARAMS as f64).sqrt();
    let want = z_update * clip / N as f64;
    assert!((sd / want - 1.0).abs() < 0.08, "noise sd {sd}, the update share's {want}");

    // Released: the mean training loss (true (39 · 1.5 + 2) / 40 = 1.5125 after clipping to
    // 2), with noise sd 2 · 2 / 40 = 0.1; nothing else the devices sent.
    let rounds = c.admin.rounds(run).await.unwrap();
    let metrics = rounds[0].metrics.clone().expect("the round releases its noised metrics");
    assert_eq!(metrics.keys().collect::<Vec<_>>(), ["loss"], "{metrics:?}");
    assert!((metrics["loss"] - 1.5125).abs() < 0.5, "{metrics:?}");
    // The pooled evaluation of the model the round trained: 40 devices (noise sd 2), accuracy
    // (39 · 0.8 + 1) / 40 = 0.805 as a ratio of noisy sums (sd about 0.06).
    let models = c.admin.models(run).await.unwrap();
    let trained = models.iter().find(|m| m.version == 0).unwrap();
    assert!((trained.n_evaluations as f64 - 40.0).abs() <= 10.0, "{trained:?}");
    let accuracy = trained.evaluation["accuracy"];
    assert!((accuracy - 0.805).abs() < 0.3, "{trained:?}");
    assert!(trained.evaluation["loss"] <= loss_bound, "{trained:?}");
    // A device's own evaluation is still refused.
    assert_own_evaluation_refused(&devices[0], run).await;
    // The metrics ride inside the accounted mechanism: ε is z's, one round at q = 1.
    let view = wait_for("the run to finish", std::time::Duration::from_secs(30), || async {
        let view = c.admin.run(run).await?;
        Ok((view.status == "finished").then_some(view))
    })
    .await
    .unwrap();
    let expected = Sampling::FixedSize.accountant(1.0, z).epsilon(1, delta_dp);
    let eps = view.privacy.unwrap().epsilon;
    assert!((eps - expected).abs() <= 1e-12 * expected, "ε {eps} vs {expected}");
    c.running.shutdown().await.unwrap();
}

/// The population is measured, not taken on trust: a plan that states 6 devices, with 5
/// online, has each round draw from the 5 that checked in, find them fewer than 6, select no
/// one and fail as `population_too_small` with what it measured. Nothing is committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dp_round_that_measures_fewer_devices_than_its_population_releases_nothing() {
    const N: usize = 5;
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let devices = enroll(&c.url, &c.admin, N).await.unwrap();
    let mut plan = PlanSpec { selection_secs: 0.5, ..PlanSpec::all_of(N, 16, 3) }.json();
    plan["strategy"] = serde_json::json!({"differential_privacy": {
        "noise_multiplier": 2.0, "clip_norm": 0.5, "population": N + 1, "delta": 1e-5}});
    let run = RunId(c.admin.create_run(&plan).await.unwrap().id);
    let failed = wait_for("a round to fail", std::time::Duration::from_secs(30), || async {
        for d in &devices {
            // Every device keeps checking in, and none is ever handed a task.
            let answer = d.check_in("default").await?;
            assert!(
                !matches!(answer, starling_core::wire::CheckInResponse::Task(_)),
                "a device was drawn from too small a population"
            );
        }
        let rounds = c.admin.rounds(run).await?;
        Ok(rounds.into_iter().find(|r| r.state == "failed"))
    })
    .await
    .unwrap();
    assert_eq!(
        failed.outcome,
        Some(serde_json::json!({"outcome": "population_too_small", "measured": 5, "minimum": 6}))
    );
    assert_eq!(failed.n_selected.unwrap(), 0);
    let view = c.admin.run(run).await.unwrap();
    assert_eq!(view.rounds_committed, 0);
    assert_eq!(view.privacy.unwrap().epsilon, 0.0, "nothing released, nothing spent");
    assert_eq!(c.admin.models(run).await.unwrap().len(), 1, "only the initial model");
    c.running.shutdown().await.unwrap();
}

/// The devices of the secure DP simulations.
const SECURE_DP_CLIENTS: usize = 10;

/// A secure DP simulation with `strategy`: ten digits devices, five drawn per round (a quorum
/// of four), for `rounds` rounds; the run, its view once every round committed, and each
/// committed model's central test accuracy by version.
async fn secure_dp_run(
    c: &InProcess,
    strategy: serde_json::Value,
    rounds: u32,
) -> (RunId, starling_core::admin::RunView, BTreeMap<i64, f64>) {
    use starling_client::simulate::{Pacing, SimulationConfig, simulate};
    let config = SimulationConfig {
        secure: true,
        strategy,
        pacing: Pacing {
            over_selection: 1.0,
            min_quorum: Some(4),
            selection_timeout_secs: 2.0,
            reporting_timeout_secs: 60.0,
        },
        ..digits_simulation(&c.url, SECURE_DP_CLIENTS, 5, rounds, 3)
    };
    let results =
        simulate(config, |r| eprintln!("model {}: accuracy {:.3}", r.version, r.test_accuracy))
            .await
            .unwrap()
            .rounds;
    assert_eq!(results.len(), rounds as usize);
    let run = c.admin.runs().await.unwrap().into_iter().next().expect("the simulation's run");
    let view = c.admin.run(RunId(run.id)).await.unwrap();
    assert_eq!(view.rounds_committed, i64::from(rounds));
    let accuracy = results.iter().map(|r| (r.version, r.test_accuracy)).collect();
    (RunId(run.id), view, accuracy)
}

/// Secure aggregation with DP and the fixed-size draw, end to end with the SDK's participants:
/// every round waits out its window, draws its cohort from the ten devices it measured, runs
/// SecAgg+ with the drawn devices clipping before masking, commits, and the run reports the
/// replace-one accountant's ε for the rounds it committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secure_dp_run_draws_its_cohorts_and_reports_their_epsilon() {
    let (z, rounds) = (4.0, 3);
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let dp = serde_json::json!({"differential_privacy": {
        "noise_multiplier": z, "clip_norm": 1.0, "population": SECURE_DP_CLIENTS, "delta": 1e-5}});
    let (run, view, _) = secure_dp_run(&c, dp, rounds).await;
    for r in c.admin.rounds(run).await.unwrap() {
        assert_eq!(r.n_selected.unwrap(), 5, "round {}: exactly the target drawn", r.round_idx);
    }
    let privacy = view.privacy.expect("a DP run shows its privacy");
    let want = Sampling::FixedSize.accountant(0.5, z).epsilon(u64::from(rounds), 1e-5);
    assert!((privacy.epsilon - want).abs() <= 1e-12 * want, "ε {} vs {want}", privacy.epsilon);
    assert!(privacy.mechanism.contains("secure"), "{}", privacy.mechanism);
    c.running.shutdown().await.unwrap();
}

/// A secure DP run with `metrics: noised`: each device's evaluation rides in its masked input
/// with the plan's loss bound as the cap, the coordinator noises the unmasked sums of the
/// evaluation entries and releases the cohort's pooled evaluation (and no training loss,
/// which a secure vector does not carry); a run that withholds its metrics releases neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secure_dp_run_releases_a_noised_pooled_evaluation_only_when_its_plan_says_so() {
    let (z, sigma_m, loss_bound, rounds) = (0.05, 0.12, 5.0, 2);
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let dp = serde_json::json!({"differential_privacy": {
        "noise_multiplier": z, "clip_norm": 1.0, "population": SECURE_DP_CLIENTS, "delta": 1e-5,
        "metrics": {"noised": {"stddev": sigma_m, "loss_bound": loss_bound}}}});
    let (run, _, central) = secure_dp_run(&c, dp, rounds).await;
    for r in c.admin.rounds(run).await.unwrap() {
        assert!(r.metrics.as_ref().is_none_or(|m| m.is_empty()), "{:?}", r.metrics);
    }
    let models = c.admin.models(run).await.unwrap();
    // Version 1 was scored centrally and evaluated by round 1's cohort of five on their
    // held-out examples (without noise the two differ by about 0.07). The count's noise sd is
    // 0.12 and the accuracy's about 0.03.
    let pooled = models.iter().find(|m| m.version == 1).unwrap();
    assert!((pooled.n_evaluations as f64 - 5.0).abs() <= 1.0, "{pooled:?}");
    let accuracy = pooled.evaluation["accuracy"];
    assert!((accuracy - central[&1]).abs() < 0.25, "pooled {accuracy} vs central {}", central[&1]);
    assert!((0.0..=loss_bound).contains(&pooled.evaluation["loss"]), "{pooled:?}");
    c.running.shutdown().await.unwrap();

    // Withheld (the default): the same run releases no evaluation at all.
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let dp = serde_json::json!({"differential_privacy": {
        "noise_multiplier": z, "clip_norm": 1.0, "population": SECURE_DP_CLIENTS, "delta": 1e-5}});
    let (run, _, _) = secure_dp_run(&c, dp, 1).await;
    for m in c.admin.models(run).await.unwrap() {
        assert_eq!(m.n_evaluations, 0, "model {}: {:?}", m.version, m.evaluation);
    }
    c.running.shutdown().await.unwrap();
}

/// The distributed discrete Gaussian's accountant written a second time, from the papers'
/// formulas, in Python with scipy (Kairouz, Liu and Steinke 2021: Theorem 1's rounded norm and
/// τ, Proposition 14; Zhu and Wang 2019, Theorem 5, for Poisson sampling; Wang, Balle and
/// Kasiviswanathan 2019, Theorem 9, for the fixed-size draw), converted to ε by
/// `dp-accounting`'s `compute_epsilon`.
const DDGAUSS_REFERENCE: &str = r#"
import json, math, sys
from scipy import special
from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon
BETA = math.exp(-0.5)
def lcomb(n, k):
    return special.gammaln(n + 1) - special.gammaln(k + 1) - special.gammaln(n - k + 1)
out = []
for clip, local, gamma, d, n, q, steps, delta, kind in json.loads(sys.argv[1]):
    c = clip / gamma
    l2 = min(c + math.sqrt(d),
             math.sqrt(c * c + d / 4 + math.sqrt(2 * math.log(1 / BETA)) * (c + math.sqrt(d) / 2)))
    l1 = l2 * min(math.sqrt(d), l2)
    s = local / gamma
    tau = 10 * sum(math.exp(-2 * math.pi ** 2 * s ** 2 * k / (k + 1)) for k in range(1, n))
    f = 2.0 if kind == "without_replacement" else 1.0
    a2 = f * l2 / (math.sqrt(n) * s)
    a1 = f * l1 / (math.sqrt(n) * s)
    def eps(a):
        return min(a / 2 * a2 ** 2 + tau * d,
                   a / 2 * (a2 ** 2 + 2 * a1 * tau + tau ** 2 * d),
                   a / 2 * (a2 + math.sqrt(d) * tau) ** 2)
    def poisson(a):
        logs = [(a - 1) * math.log1p(-q) + math.log(a * q - q + 1),
                lcomb(a, 2) + 2 * math.log(q) + (a - 2) * math.log1p(-q) + eps(2)]
        logs += [math.log(3) + lcomb(a, l) + (a - l) * math.log1p(-q) + l * math.log(q)
                 + (l - 1) * eps(l) for l in range(3, a + 1)]
        return special.logsumexp(logs) / (a - 1)
    def without_replacement(a):
        e2 = eps(2)
        second = min(math.log(4) + e2 + math.log1p(-math.exp(-e2)), math.log(2) + e2)
        logs = [0.0, 2 * math.log(q) + lcomb(a, 2) + second]
        logs += [j * math.log(q) + lcomb(a, j) + math.log(2) + (j - 1) * eps(j)
                 for j in range(3, a + 1)]
        return special.logsumexp(logs) / (a - 1)
    amplified = poisson if kind == "poisson" else without_replacement
    orders = list(range(2, 129)) + [256]
    rdp = [steps * (eps(a) if q >= 1 else min(amplified(a), eps(a))) for a in orders]
    out.append(compute_epsilon(orders, rdp, delta)[0])
print(json.dumps(out))
"#;

/// Ours against the reference, for wide noise (as plans size it: τ vanishes) and narrow noise
/// (τ and the rounding matter), both samplings. They agree to 1e-9 relative (the worst seen is
/// about 1e-13), so any change of a formula is caught.
#[test]
fn the_distributed_dp_accountant_agrees_with_the_papers_formulas_to_1e_9() {
    use starling_core::privacy::DistributedNoise;
    let Some(python) = python_with(&["dp_accounting", "scipy"]) else { return };
    // Each device's noise about one grid step wide: τ·d is of order 1.
    let narrow = |sigma_on_grid: f64, d: usize, n: u32| {
        let gamma = 0.2;
        DistributedNoise {
            clip_norm: 1.0,
            local_stddev: sigma_on_grid * gamma,
            gamma,
            n_params: d,
            min_survivors: n,
            cohort: n,
        }
    };
    let planned = |z: f64, n_params: usize, cohort: u32, survivors: u32| {
        DistributedNoise::for_plan(z, 1.0, n_params, cohort, survivors).unwrap()
    };
    let cases: Vec<(DistributedNoise, f64, u64, f64)> = vec![
        (planned(1.1, 199_210, 100, 80), 0.1, 30, 1e-5),
        (planned(2.6, 199_210, 100, 80), 0.1, 30, 1e-5),
        (planned(0.9, 5_000, 50, 50), 0.01, 1000, 1e-6),
        (planned(4.0, 1_000, 10, 4), 1.0, 3, 1e-5),
        (narrow(1.0, 1024, 20), 0.05, 100, 1e-5),
        (narrow(1.2, 256, 10), 0.2, 10, 1e-5),
        (narrow(0.9, 4096, 50), 1.0, 5, 1e-5),
    ];
    for (kind, sampling) in
        [("poisson", Sampling::Poisson), ("without_replacement", Sampling::FixedSize)]
    {
        let grid: Vec<_> = cases
            .iter()
            .map(|(d, q, steps, delta)| {
                (
                    d.clip_norm,
                    d.local_stddev,
                    d.gamma,
                    d.padded_len(),
                    d.min_survivors,
                    *q,
                    *steps,
                    *delta,
                    kind,
                )
            })
            .collect();
        let output = Command::new(&python)
            .args(["-c", DDGAUSS_REFERENCE, &serde_json::to_string(&grid).unwrap()])
            .output()
            .expect("running Python");
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        let want: Vec<f64> = serde_json::from_slice(&output.stdout).expect("a list of ε");
        for ((noise, q, steps, delta), want) in cases.iter().zip(want) {
            let got = noise.epsilon(sampling, *q, *steps, *delta);
            let rel = (got - want).abs() / want;
            eprintln!(
                "{kind} σ/γ={:.3e} d={} n={} q={q} steps={steps}: ours {got:.6}, reference {want:.6}, rel {rel:.1e}",
                noise.local_stddev / noise.gamma,
                noise.padded_len(),
                noise.min_survivors
            );
            assert!(rel <= 1e-9, "{kind}: ε {got} vs {want}");
        }
    }
}

/// Distributed DP through secure aggregation, end to end with the SDK's participants: devices
/// clip, rotate, round and add discrete Gaussian noise before masking, every round commits, and
/// the run reports the distributed discrete Gaussian's ε for the rounds it committed. A plan
/// asking for distributed noise without secure aggregation, or without the survivors it counts
/// on, is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_distributed_dp_run_commits_noisy_sums_and_reports_their_epsilon() {
    use starling_core::privacy::DistributedNoise;
    let (z, rounds) = (1.0, 3);
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let dp = serde_json::json!({"differential_privacy": {
        "noise_multiplier": z, "clip_norm": 1.0, "population": SECURE_DP_CLIENTS, "delta": 1e-5,
        "noise": "distributed", "min_survivors": 4}});
    let (_, view, _) = secure_dp_run(&c, dp.clone(), rounds).await;
    let privacy = view.privacy.expect("a DP run shows its privacy");
    // The digits MLP: 64·64 + 64 + 64·64 + 64 + 64·10 + 10 parameters.
    let noise = DistributedNoise::for_plan(z, 1.0, 8970, 5, 4).unwrap();
    let want = noise.epsilon(Sampling::FixedSize, 0.5, u64::from(rounds), 1e-5);
    assert!((privacy.epsilon - want).abs() <= 1e-12 * want, "ε {} vs {want}", privacy.epsilon);
    assert!(privacy.mechanism.contains("discrete Gaussian"), "{}", privacy.mechanism);
    assert!(privacy.accounting.contains("at least 4 survivors"), "{}", privacy.accounting);
    assert_eq!(privacy.epsilon_pld, None);

    let mut plain = PlanSpec::all_of(SECURE_DP_CLIENTS, 16, 3).json();
    plain["strategy"] = dp.clone();
    let err = c.admin.create_run(&plain).await.unwrap_err().to_string();
    assert!(err.contains("needs secure_aggregation"), "{err}");
    c.running.shutdown().await.unwrap();
}

/// A `selection: poisson` plan drawing its whole population (q = 1) was accepted; the PLD
/// accountant then panicked at the first round's close, the driver task died (admin views
/// answered nothing, new runs 503, `/readyz` still 200), and the coordinator panicked again
/// in recovery, so it could not start on that store. Now the plan is a 422 naming the field,
/// and a store that holds such a run from before starts: the run is stopped with the reason
/// in its view, `/readyz` is 200, and other runs go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poisson_plan_drawing_everyone_is_refused_and_never_stops_the_coordinator() {
    use starling_coordinator::driver::InitialModel;
    use starling_coordinator::store::{NewRun, SqlStore};
    let mut plan = PlanSpec::all_of(2, 16, 3).json();
    plan["selection"] = "poisson".into();
    plan["strategy"] = serde_json::json!({"differential_privacy": {
        "noise_multiplier": 1.0, "clip_norm": 1.0, "population": 2, "delta": 1e-5}});
    // A run an older coordinator accepted, in the store before this one starts.
    let (_dir, db) = sqlite_db();
    let store = SqlStore::connect(&db, true).await.unwrap();
    let schema = PlanSpec::all_of(2, 16, 3).schema();
    let initial = InitialModel::new(&schema, vec![0.0; 16]);
    let plan_json = plan.to_string();
    let old = NewRun {
        name: Some("accepted before"),
        population: "default",
        plan_json: &plan_json,
        initial_model: &initial.encoded,
        initial_model_hash: &initial.hash,
        exclusive_population: false,
    };
    let old = store.create_run(old, 1).await.unwrap();
    drop(store);

    let c = start_in_process(&db).await.unwrap();
    let stopped = c.admin.run(old).await.unwrap();
    assert_eq!(stopped.status, "stopped");
    let reason = stopped.stop_reason.unwrap_or_default();
    assert!(reason.contains("population") && reason.contains("poisson"), "{reason}");
    let ready = http_client().get(format!("{}/readyz", c.url)).send().await.unwrap();
    assert_eq!(ready.status().as_u16(), 200);
    match c.admin.create_run(&plan).await {
        Err(starling_client::protocol::ClientError::Api { status, body }) => {
            assert_eq!(status.as_u16(), 422);
            let named = body.message.contains("strategy.differential_privacy: population");
            assert!(named, "{body:?}");
        }
        other => panic!("a poisson plan with q = 1 was not refused: {other:?}"),
    }
    // Another run goes on: it opens its rounds and commits.
    let devices = enroll(&c.url, &c.admin, 2).await.unwrap();
    let run = RunId(c.admin.create_run(&PlanSpec::all_of(2, 16, 1).json()).await.unwrap().id);
    wait_round_open(&c.admin, run, 0).await.unwrap();
    let tasks = expect_tasks(&devices).await.unwrap();
    for (i, d) in devices.iter().enumerate() {
        d.upload(run, tasks[i].round_idx, &upload_request(&tasks[i], &delta(i, 0, 16), 1))
            .await
            .unwrap();
    }
    wait_model(&c.admin, run, 1).await.unwrap();
    c.running.shutdown().await.unwrap();
}

/// The size of a Poisson draw tells whether one more device was in the population, and a
/// device's example count is a fact about its data: a DP run with Poisson selection shows no
/// cohort size (selected, reported, dropped, refused, upload bytes) and no record of who was
/// drawn (a 422 naming why); a DP run with the fixed-size draw shows its (public) cohort size
/// but, like every DP run, no example counts; a plain run shows everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poisson_dp_run_shows_no_cohort_sizes_and_no_one_drawn() {
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let dp = serde_json::json!({"differential_privacy": {
        "noise_multiplier": 1.0, "clip_norm": 1.0, "population": 8, "delta": 1e-5}});
    let create = |selection: &'static str, strategy: Option<serde_json::Value>| {
        let mut plan = PlanSpec::all_of(2, 16, 3).json();
        plan["selection"] = selection.into();
        if let Some(strategy) = strategy {
            plan["strategy"] = strategy;
        }
        let admin = c.admin.clone();
        async move { RunId(admin.create_run(&plan).await.unwrap().id) }
    };
    let poisson = create("poisson", Some(dp.clone())).await;
    let fixed_size = create("random", Some(dp)).await;
    let plain = create("random", None).await;
    for run in [poisson, fixed_size, plain] {
        wait_round_open(&c.admin, run, 0).await.unwrap();
    }
    let round = c.admin.round(poisson, 0).await.unwrap();
    let counts = (round.n_selected, round.n_reported, round.n_dropped, round.upload_bytes);
    assert_eq!(counts, (None, None, None, None), "{round:?}");
    assert!(c.admin.rounds(poisson).await.unwrap().iter().all(|r| r.n_selected.is_none()));
    match c.admin.round_devices(poisson, 0).await {
        Err(starling_client::protocol::ClientError::Api { status, body }) => {
            assert_eq!(status.as_u16(), 422);
            assert!(body.message.contains("poisson"), "{body:?}");
        }
        other => panic!("a Poisson DP run showed who was drawn: {other:?}"),
    }
    for run in [fixed_size, plain] {
        let round = c.admin.round(run, 0).await.unwrap();
        assert_eq!((round.n_selected, round.n_reported), (Some(0), Some(0)), "run {run}");
        assert!(c.admin.round_devices(run, 0).await.unwrap().is_empty(), "no one checked in");
    }
    c.running.shutdown().await.unwrap();
}

/// BLT-FTRL's accounting, written again from the papers (McMahan, Xu and Zhang 2024; Balle and
/// Wang 2018) in Python with numpy and scipy: the strategy matrix `C` built whole, its
/// sensitivity as the largest column-sum norm over every participation pattern the rule allows
/// (enumerated outright where that is small, the earliest pattern otherwise), μ = sens / z,
/// and ε at δ by root-finding on the Gaussian mechanism's exact δ(ε) with scipy's normal CDF.
/// Also `dp-accounting`'s PLD accountant of one Gaussian mechanism of noise multiplier 1/μ, as
/// a second anchor (discretized: it agrees to about 1e-3).
const BLT_REFERENCE: &str = r#"
import itertools, json, math, sys
import numpy as np
from scipy import optimize, stats
import dp_accounting
out = []
for omega, lam, n, b, k, z, delta in json.loads(sys.argv[1]):
    c = np.zeros((n, n))
    for t in range(n):
        for s in range(t + 1):
            c[t, s] = 1.0 if t == s else omega * lam ** (t - s - 1)
    def norm(pattern):
        return np.linalg.norm(c[:, list(pattern)].sum(axis=1)) if pattern else 0.0
    if n <= 16:
        patterns = [p for r in range(1, k + 1) for p in itertools.combinations(range(n), r)
                    if all(y - x >= b for x, y in zip(p, p[1:]))]
        sens = max(norm(p) for p in patterns)
    else:
        sens = norm([i * b for i in range(k) if i * b < n])
    mu = sens / z
    def excess(eps):
        return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2) - delta
    hi = 1.0
    while excess(hi) > 0:
        hi *= 2
    eps = 0.0 if excess(0.0) <= 0 else optimize.brentq(excess, 0.0, hi, xtol=1e-14, rtol=1e-15)
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    pld.compose(dp_accounting.GaussianDpEvent(1.0 / mu))
    out.append([sens, eps, pld.get_epsilon(delta)])
print(json.dumps(out))
"#;

/// Ours against the reference: the sensitivity and ε of hand-picked strategies (independent
/// noise, the all-ones extreme, decaying ones) on small runs where every pattern is
/// enumerated, and of the strategy a plan chooses on a 200-round run. Sensitivity and ε agree
/// to 1e-9 relative, and `dp-accounting`'s PLD ε to 2e-3.
#[test]
fn the_blt_ftrl_accountant_agrees_with_a_reference_to_1e_9() {
    use starling_core::privacy::blt::{Blt, Schema, epsilon_of_gdp};
    let Some(python) = python_with(&["dp_accounting", "scipy", "numpy"]) else { return };
    let chosen =
        Blt::optimized(&Schema { rounds: 200, min_separation: 20, max_participations: 10 });
    let cases: Vec<(Blt, u64, u64, u64, f64, f64)> = vec![
        (Blt::INDEPENDENT, 12, 3, 4, 1.0, 1e-5),
        (Blt { omega: 1.0, lambda: 1.0 }, 12, 3, 4, 2.0, 1e-5),
        (Blt { omega: 0.6, lambda: 0.9 }, 14, 2, 5, 1.5, 1e-6),
        (Blt { omega: 0.35, lambda: 0.98 }, 15, 4, 3, 0.8, 1e-5),
        (Blt { omega: 0.9, lambda: 0.5 }, 10, 1, 10, 3.0, 1e-5),
        (chosen, 200, 20, 10, 4.0, 1e-5),
    ];
    let grid: Vec<_> = cases
        .iter()
        .map(|(blt, n, b, k, z, delta)| (blt.omega, blt.lambda, n, b, k, z, delta))
        .collect();
    let output = Command::new(&python)
        .args(["-c", BLT_REFERENCE, &serde_json::to_string(&grid).unwrap()])
        .output()
        .expect("running Python");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let want: Vec<[f64; 3]> = serde_json::from_slice(&output.stdout).expect("[sens, ε, ε_pld]s");
    for ((blt, n, b, k, z, delta), [sens, eps, eps_pld]) in cases.iter().zip(want) {
        let schema = Schema { rounds: *n, min_separation: *b, max_participations: *k };
        let ours_sens = blt.sensitivity(&schema);
        let ours = epsilon_of_gdp(ours_sens / z, *delta);
        eprintln!(
            "ω={:.4} λ={:.4} n={n} b={b} k={k} z={z}: sens {ours_sens:.9} vs {sens:.9}, ε {ours:.9} vs {eps:.9} (PLD {eps_pld:.6})",
            blt.omega, blt.lambda
        );
        assert!((ours_sens - sens).abs() <= 1e-9 * sens, "sensitivity {ours_sens} vs {sens}");
        assert!((ours - eps).abs() <= 1e-9 * eps, "ε {ours} vs {eps}");
        assert!((ours - eps_pld).abs() <= 2e-3 * eps_pld, "ε {ours} vs PLD {eps_pld}");
    }
}

/// Checks `device` in until it holds a task or `until` passes (then `None`): a device of a DP
/// run with random selection is told to come back after the selection window, and drawn or
/// not then.
async fn task_until(
    device: &starling_client::protocol::FleetClient,
    until: std::time::Instant,
) -> anyhow::Result<Option<starling_core::wire::TaskAssignment>> {
    use starling_core::wire::CheckInResponse;
    loop {
        match device.check_in("default").await? {
            CheckInResponse::Task(t) => return Ok(Some(t)),
            CheckInResponse::ComeBackLater { .. } if std::time::Instant::now() >= until => {
                return Ok(None);
            }
            CheckInResponse::ComeBackLater { .. } => {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    }
}

/// A `blt_ftrl` run through the coordinator: four devices, two a round, each at most twice
/// and at least two committed rounds apart. The rule leaves one way to run four rounds, and
/// the coordinator takes it: {a, b}, then the other two (a and b must wait), then a and b
/// again, then the other two; a coordinator restarted after the second round refuses that
/// round's devices when they alone check in for the third (it counts them again from the
/// store), and that round selects no one. The run
/// shows the Gaussian mechanism's ε for its μ and the zCDP ρ, names the rule, and shows no
/// cohort sizes or cohorts; every committed model moved by the cohort's mean plus noise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blt_ftrl_run_enforces_its_participation_rule_across_a_restart() {
    const PARAMS: usize = 64;
    let (_dir, db) = sqlite_db();
    let mut c = start_in_process(&db).await.unwrap();
    let mut devices = enroll(&c.url, &c.admin, 4).await.unwrap();
    let spec = PlanSpec { selection_secs: 1.0, ..PlanSpec::all_of(2, PARAMS, 4) };
    let mut plan = spec.json();
    plan["strategy"] = serde_json::json!({"differential_privacy": {
        "noise_multiplier": 1.0, "clip_norm": 1.0, "delta": 1e-5, "mechanism": "blt_ftrl",
        "min_separation": 2, "max_participations": 2}});
    let run = RunId(c.admin.create_run(&plan).await.unwrap().id);
    let window = || std::time::Instant::now() + std::time::Duration::from_secs(3);
    let mut cohorts: Vec<std::collections::BTreeSet<usize>> = vec![];
    // The round on model `version`: `which` check in through selection windows until drawn;
    // those drawn upload. The cohort drawn.
    for version in 0..4i64 {
        let which: Vec<usize> = match version {
            2 => {
                // Restart between the rounds, on the same store (and so another port).
                c.running.shutdown().await.unwrap();
                c = start_in_process(&db).await.unwrap();
                devices = devices
                    .iter()
                    .map(|d| {
                        let credential = d.credential().expect("enrolled");
                        starling_client::protocol::FleetClient::with_credential(&c.url, credential)
                    })
                    .collect();
                // Only last round's devices check in: the restarted coordinator counts their
                // selections from the store and draws neither, so its rounds select no one.
                for &i in &cohorts[1] {
                    let task = task_until(&devices[i], window()).await.unwrap();
                    assert!(task.is_none(), "device {i} drawn one round after its last");
                }
                cohorts[0].iter().copied().collect()
            }
            _ => (0..4).collect(),
        };
        let tasks = futures_util::future::try_join_all(
            which.iter().map(|&i| task_until(&devices[i], window())),
        )
        .await
        .unwrap();
        let mut drawn = std::collections::BTreeSet::new();
        let mut uploads = vec![];
        let first_task = tasks.iter().flatten().next().expect("someone is drawn").clone();
        let global =
            model_values(&devices[0], &first_task.model_hash, &first_task.schema).await.unwrap();
        for (&i, task) in which.iter().zip(&tasks) {
            if let Some(t) = task {
                assert_eq!(t.model_version.0, version);
                let u = delta(i, version, PARAMS);
                devices[i].upload(run, t.round_idx, &upload_request(t, &u, 1)).await.unwrap();
                drawn.insert(i);
                uploads.push(u);
            }
        }
        let hash = wait_model(&c.admin, run, version + 1).await.unwrap();
        if version == 0 {
            // The first round's noise is the fresh draw alone: N(0, (z·C / cohort)²) = N(0, ½²).
            let got = model_values(&devices[0], &hash, &first_task.schema).await.unwrap();
            let noise = dp_noise(&global, &got, &uploads, 1.0);
            let sd = (noise.iter().map(|n| n * n).sum::<f64>() / noise.len() as f64).sqrt();
            assert!((0.3..0.7).contains(&sd), "the first round's noise has sd {sd}, not 0.5");
        }
        cohorts.push(drawn);
    }
    let first = cohorts[0].clone();
    let others: std::collections::BTreeSet<usize> = (0..4).filter(|i| !first.contains(i)).collect();
    assert_eq!(first.len(), 2, "{cohorts:?}");
    assert_eq!(
        cohorts,
        vec![first.clone(), others.clone(), first, others],
        "the only schedule the rule allows"
    );

    let view = c.admin.run(run).await.unwrap();
    let privacy = view.privacy.expect("a DP run shows its privacy");
    let validated =
        serde_json::from_value::<starling_core::plan::Plan>(plan).unwrap().validate().unwrap();
    let want = validated.privacy().unwrap();
    assert!((privacy.epsilon - want.epsilon_after(4)).abs() <= 1e-12 * privacy.epsilon);
    assert_eq!(privacy.zcdp_rho, want.zcdp_rho(4));
    assert!(
        privacy.accounting.contains("BLT-FTRL") && privacy.accounting.contains("at most 2 times"),
        "{}",
        privacy.accounting
    );
    let round = c.admin.round(run, 1).await.unwrap();
    assert_eq!((round.n_selected, round.n_reported), (None, None), "{round:?}");
    assert!(c.admin.round_devices(run, 1).await.is_err(), "who took part is not shown");
    assert_eq!(view.rounds_committed, 4);
    c.running.shutdown().await.unwrap();
}

/// DP-FTRL composes with SecAgg+: ten digits devices, five a round, each at most twice and two
/// committed rounds apart, clip before masking; the coordinator adds the correlated noise to
/// the unmasked sum, every round commits, and the run reports the ε of its μ after three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secure_blt_ftrl_run_commits_through_secagg_and_reports_its_epsilon() {
    use starling_core::privacy::blt::{Blt, Schema, epsilon_of_gdp};
    let (z, rounds) = (1.0, 3);
    let (_dir, db) = sqlite_db();
    let c = start_in_process(&db).await.unwrap();
    let dp = serde_json::json!({"differential_privacy": {
        "noise_multiplier": z, "clip_norm": 1.0, "delta": 1e-5, "mechanism": "blt_ftrl",
        "min_separation": 2, "max_participations": 2}});
    let (_, view, _) = secure_dp_run(&c, dp, rounds).await;
    let privacy = view.privacy.expect("a DP run shows its privacy");
    let schema = Schema { rounds: 3, min_separation: 2, max_participations: 2 };
    let want = epsilon_of_gdp(Blt::optimized(&schema).sensitivity(&schema) / z, 1e-5);
    assert!((privacy.epsilon - want).abs() <= 1e-12 * want, "ε {} vs {want}", privacy.epsilon);
    assert!(privacy.mechanism.contains("DP-FTRL"), "{}", privacy.mechanism);
    c.running.shutdown().await.unwrap();
}

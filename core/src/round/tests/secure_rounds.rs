//! Secure rounds: the machine driven by real SecAgg+ clients, honest and poisoned.

use std::collections::BTreeMap;

use super::*;
use crate::plan::SecureRoundConfig;
use crate::secagg::{self, Client};
use crate::wire::SecAggInstruction;

const LEN: usize = 20;

pub(super) fn secure_config() -> RoundConfig {
    RoundConfig {
        cohort_size: 10,
        target_selected: 10,
        min_quorum: 5,
        selection_timeout_ms: 1_000,
        reporting_timeout_ms: 5_000,
        total_rounds: 1,
        secure: Some(SecureRoundConfig {
            clip_norm: None,
            distributed: None,
            evaluation_loss_cap: None,
            clip: 1.0,
            max_examples: 100,
            // Each device loses at most 3 of its 8 neighbours below: 5 shares remain.
            k: 8,
            t: 5,
            // The layout before evaluations travelled in the vector: no evaluation entries.
            n_params: LEN,
            vector_len: LEN + 1,
            stage_timeout_ms: 1_000,
        }),
        ..config()
    }
}

/// Devices 1..=10 and their secrets; the records the machine asked to persist.
/// What a poisoning device masks instead of its encoded update, given the fleet.
pub(super) type Poison = fn(&Fleet, Vec<u32>) -> Vec<u32>;

pub(super) struct Fleet {
    m: RunMachine,
    now: Millis,
    next_request: u64,
    clients: BTreeMap<i64, Client>,
    pub(super) task: Option<crate::wire::SecureAggregationTask>,
    records: Vec<Record>,
    replies: BTreeMap<RequestId, Action>,
    pub(super) aggregate: Option<Aggregate>,
    /// The unmasking the machine handed over, as it was handed over.
    sum: Option<secure::SecureSum>,
    closing: Option<RoundClosing>,
    /// A device that seals a share that does not open to its first neighbour.
    garble: Option<i64>,
    /// A device that masks ring elements of its own choosing instead of its encoded update
    /// (made from what the honest survivors encode).
    pub(super) poison: Option<(i64, Poison)>,
    /// Why the driver could not finish the handed-over sum, when it could not.
    pub(super) refused: Option<AggregateError>,
}

fn delta(device: i64) -> Vec<f32> {
    (0..LEN).map(|i| ((device * 7 + i as i64) % 11) as f32 / 40.0 - 0.12).collect()
}

fn examples(device: i64) -> u64 {
    10 + device as u64 * 3
}

impl Fleet {
    pub(super) fn new() -> Self {
        let m = RunMachine::start(RunId(7), secure_config(), 0, [9; 32]);
        let mut f = Fleet {
            m,
            now: 0,
            next_request: 0,
            clients: BTreeMap::new(),
            task: None,
            records: vec![],
            replies: BTreeMap::new(),
            aggregate: None,
            sum: None,
            closing: None,
            garble: None,
            poison: None,
            refused: None,
        };
        f.drain();
        f
    }

    fn drain(&mut self) {
        while let Some(a) = self.m.poll_action() {
            match a {
                Action::PersistSecAgg { seq, record, .. } => {
                    assert_eq!(seq as usize, self.records.len(), "records are numbered in order");
                    self.records.push(record);
                }
                Action::ReplyCheckIn { request, .. }
                | Action::ReplySecAgg { request, .. }
                | Action::ReplySecAggPoll { request, .. } => {
                    self.replies.insert(request, a);
                }
                Action::CloseRound { closing: c, sum } => {
                    if let RoundSum::Secure(sum) = sum {
                        // The coordinator reads a withdrawn device's vector from the records.
                        let withdrawn =
                            self.records.iter().filter_map(|r| sum.withdrawn_input(r)).collect();
                        match sum.finish(&withdrawn) {
                            Ok((aggregate, _)) => self.aggregate = Some(aggregate),
                            Err(e) => self.refused = Some(e),
                        }
                        self.sum = Some(*sum);
                    }
                    self.closing = Some(c);
                }
                _ => {}
            }
        }
    }

    fn input(&mut self, make: impl FnOnce(RequestId) -> Input) -> Action {
        self.next_request += 1;
        let request = RequestId(self.next_request);
        self.m.handle(self.now, make(request));
        self.drain();
        self.replies.remove(&request).expect("every request is answered")
    }

    fn advance(&mut self, to: Millis) {
        self.now = to;
        self.m.handle_timeout(to);
        self.drain();
    }

    fn join(&mut self, device: i64) {
        let Action::ReplyCheckIn { decision: CheckInDecision::Selected { secure, .. }, .. } = self
            .input(|request| Input::CheckIn {
                request,
                device: DeviceId(device),
                attributes: Default::default(),
                online: 10,
            })
        else {
            panic!("device {device} not selected");
        };
        let task = secure.expect("a secure run hands out a secure task");
        let mut randomness = [0u8; 96];
        for (i, part) in randomness.chunks_mut(32).enumerate() {
            use sha2::Digest;
            part.copy_from_slice(&sha2::Sha256::digest([device as u8, i as u8]));
        }
        let identity = secagg::DeviceIdentity::from_secret([device as u8; 32]);
        let (client, keys) = Client::new(task.index, task.config, identity, randomness).unwrap();
        self.clients.insert(device, client);
        self.task = Some(task);
        self.send(device, SecAggUpload::AdvertiseKeys(keys)).unwrap();
    }

    fn send(&mut self, device: i64, message: SecAggUpload) -> Result<(), SecAggRejection> {
        let Action::ReplySecAgg { result, .. } = self.input(|request| Input::SecAgg {
            request,
            device: DeviceId(device),
            round_idx: RoundIdx(0),
            message,
        }) else {
            panic!("wrong reply")
        };
        result
    }

    fn poll(&mut self, device: i64) -> SecAggInstruction {
        let Action::ReplySecAggPoll { result, .. } = self.input(|request| Input::SecAggPoll {
            request,
            device: DeviceId(device),
            round_idx: RoundIdx(0),
        }) else {
            panic!("wrong reply")
        };
        result.unwrap()
    }

    /// Each device's next step, whatever the stage asks.
    fn step(&mut self, device: i64) {
        let message = match self.poll(device) {
            SecAggInstruction::ShareKeys(n) => {
                let mut sealed = self.clients.get_mut(&device).unwrap().share_keys(n).unwrap();
                // A device that seals garbage signs what it sends.
                if self.garble == Some(device) {
                    sealed[0].ciphertext[0] ^= 0xff;
                    let session = self.task.as_ref().expect("a secure task").config.session;
                    sealed[0]
                        .sign(&secagg::DeviceIdentity::from_secret([device as u8; 32]), &session);
                }
                SecAggUpload::ShareKeys(sealed)
            }
            SecAggInstruction::MaskedInput(r) => {
                let mut input = self.encoded(device);
                if let Some((attacker, poison)) = self.poison
                    && attacker == device
                {
                    input = poison(self, input);
                }
                let client = self.clients.get_mut(&device).unwrap();
                let y = client.masked_input(r, &input).unwrap();
                SecAggUpload::MaskedInput {
                    model_version: ModelVersion(0),
                    masked: y.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    accusations: client.accusations(),
                }
            }
            SecAggInstruction::SignSurvivors(r) => SecAggUpload::SignSurvivors(
                self.clients.get_mut(&device).unwrap().sign_survivors(r).unwrap(),
            ),
            SecAggInstruction::Unmask(r) => {
                SecAggUpload::Unmask(self.clients.get_mut(&device).unwrap().unmask(r).unwrap())
            }
            other => panic!("device {device}: unexpected {other:?}"),
        };
        self.send(device, message).unwrap();
    }

    /// What an honest `device` masks: its delta and weight, quantized.
    pub(super) fn encoded(&self, device: i64) -> Vec<u32> {
        let task = self.task.unwrap();
        secagg::encode_weighted(
            &task.quantizer(),
            &delta(device),
            examples(device),
            task.max_examples,
        )
    }

    fn restored(&self, now: Millis) -> RunMachine {
        let selected = (1..=10).map(DeviceId).collect();
        let snapshot = RunSnapshot {
            run_id: RunId(7),
            config: secure_config(),
            model_version: ModelVersion(0),
            rounds_committed: 0,
            next_round_idx: RoundIdx(1),
            carried: vec![],
            strikes: Default::default(),
            participations: Default::default(),
            open_round: Some(OpenRoundSnapshot {
                round: self.m.current_round().unwrap(),
                selected,
                reported: vec![],
                secure_records: self.records.clone(),
                assignments: vec![],
                partials: vec![],
            }),
        };
        RunMachine::restore(snapshot, now, [1; 32])
    }
}

fn expected_mean(survivors: &[i64]) -> Vec<f64> {
    let total: f64 = survivors.iter().map(|&d| examples(d) as f64).sum();
    (0..LEN)
        .map(|i| {
            survivors.iter().map(|&d| examples(d) as f64 * f64::from(delta(d)[i])).sum::<f64>()
                / total
        })
        .collect()
}

pub(super) fn run(restart_after_share: bool) -> (Aggregate, RoundClosing) {
    let mut f = run_fleet(restart_after_share);
    let closing = f.closing.expect("the round closed");
    (f.aggregate.take().unwrap_or_else(|| panic!("no aggregate: {closing:?}")), closing)
}

/// Ten devices; two drop while training, one before unmasking.
fn run_fleet(restart_after_share: bool) -> Fleet {
    run_fleet_with(restart_after_share, Fleet::new())
}

pub(super) fn run_fleet_with(restart_after_share: bool, mut f: Fleet) -> Fleet {
    for d in 1..=10 {
        f.join(d);
    }
    // A plain upload is refused in a secure run, and a retried message is answered again.
    let keys = match &f.records[2] {
        Record::Message { message, .. } => message.clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(f.send(1, keys.clone()), Ok(()));
    // Selection reached its target and every device advertised: ShareKeys is open.
    for d in 1..=10 {
        f.step(d);
    }
    if restart_after_share {
        let records = f.records.len();
        f.m = f.restored(f.now);
        f.drain();
        assert_eq!(f.records.len(), records, "replay persists nothing new");
    }
    // Devices 9 and 10 drop out while training; the others mask.
    for d in 1..=8 {
        f.step(d);
    }
    assert!(matches!(f.poll(9), SecAggInstruction::MaskedInput(_)));
    assert!(matches!(f.poll(1), SecAggInstruction::Wait { .. }));
    f.advance(5_000);
    // Device 8 drops before the consistency check; the rest sign the survivor set.
    for d in 1..=7 {
        f.step(d);
    }
    assert!(matches!(f.poll(9), SecAggInstruction::Excluded { .. }));
    assert!(f.aggregate.is_none());
    // The signing deadline passes without 8; every signer unmasks.
    f.advance(6_000);
    for d in 1..=7 {
        f.step(d);
    }
    f.advance(7_000);
    f
}

/// The machine rebuilds the sum's secrets and stops there. The model-sized work
/// of unmasking (n vectors added, a keystream expanded per mask, the mean decoded) is a
/// `SecureSum` the driver finishes on a blocking thread, so no run waits for it; finishing
/// it there gives the same bits as anywhere.
#[test]
fn the_machine_hands_unmasking_to_the_driver_to_finish_elsewhere() {
    let mut f = run_fleet(false);
    let sum = f.sum.take().expect("the machine handed over the unmasking");
    assert_eq!(sum.survivors(), 8);
    let none = BTreeMap::new();
    let here = sum.finish(&none).expect("the sum decodes");
    let elsewhere = std::thread::spawn(move || sum.finish(&BTreeMap::new()));
    let elsewhere = elsewhere.join().expect("no panic");
    assert_eq!(elsewhere, Ok(here));
}

#[test]
fn secure_round_commits_the_survivors_weighted_mean() {
    let (aggregate, closing) = run(false);
    assert_eq!(closing.outcome, RoundOutcome::Commit);
    assert_eq!((closing.n_selected, closing.n_reported, closing.n_dropped), (10, 8, 2));
    // Device 8 sent its masked input before dropping: it is in the sum.
    let want = expected_mean(&[1, 2, 3, 4, 5, 6, 7, 8]);
    for (got, want) in aggregate.mean_delta.iter().zip(&want) {
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
    }
    assert_eq!(aggregate.n_updates, 8);
}

#[test]
fn a_restart_between_stages_replays_to_the_same_result() {
    let (plain, _) = run(false);
    let (restarted, closing) = run(true);
    assert_eq!(closing.outcome, RoundOutcome::Commit);
    assert_eq!(plain.mean_delta, restarted.mean_delta);
}

/// A device that seals a share that does not open to a neighbour is left out
/// by the machine too: the round commits the other nine's exact mean, counts nine
/// reports, and tells the sender it is excluded.
#[test]
fn a_device_sealing_a_bad_share_is_left_out_of_the_commit() {
    let mut f = Fleet::new();
    f.garble = Some(3);
    for d in 1..=10 {
        f.join(d);
    }
    for _share_then_mask in 0..2 {
        for d in 1..=10 {
            f.step(d);
        }
    }
    // Consistency check: the sender is told why it is out; the others sign, then unmask.
    let told = f.poll(3);
    assert!(
        matches!(&told, SecAggInstruction::Excluded { reason } if reason.contains("could not open")),
        "{told:?}"
    );
    for _sign_then_unmask in 0..2 {
        for d in (1..=10).filter(|&d| d != 3) {
            f.step(d);
        }
    }
    f.advance(6_000);
    let closing = f.closing.expect("the round closed");
    assert_eq!(closing.outcome, RoundOutcome::Commit);
    assert_eq!((closing.n_reported, closing.n_dropped), (9, 1));
    let aggregate = f.aggregate.take().expect("a sum");
    let want = expected_mean(&[1, 2, 4, 5, 6, 7, 8, 9, 10]);
    for (got, want) in aggregate.mean_delta.iter().zip(&want) {
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
    }
}

#[test]
fn too_few_masked_inputs_fail_the_round() {
    let mut f = Fleet::new();
    for d in 1..=10 {
        f.join(d);
    }
    for d in 1..=10 {
        f.step(d);
    }
    for d in 1..=4 {
        f.step(d);
    }
    f.advance(5_000);
    let closing = f.closing.expect("closed");
    assert_eq!(
        closing.outcome,
        RoundOutcome::SecureAggregationFailed { stage: secure::Stage::MaskedInput, survivors: 4 }
    );
    assert!(f.aggregate.is_none());
    assert!(matches!(f.poll(1), SecAggInstruction::Excluded { .. }));
}

/// A device masks what it likes: the ring elements are its own. One that wrapped the weights'
/// sum to just above nothing made the decoded mean of honest updates about 0.01 explode, and it
/// committed. The unmasked sum is now checked against what the survivors' inputs inside the
/// quantization range can add up to, and such a round fails, never commits.
mod poisoned_sums {
    use super::*;

    /// The survivors of `run_fleet` (9 and 10 drop while training).
    const SURVIVORS: std::ops::RangeInclusive<i64> = 1..=8;

    fn refused(poison: Poison) -> AggregateError {
        let mut f = Fleet::new();
        f.poison = Some((3, poison));
        let f = run_fleet_with(false, f);
        assert!(f.aggregate.is_none(), "a poisoned sum was decoded: {:?}", f.aggregate);
        f.refused.expect("the driver refuses the sum")
    }

    #[test]
    fn a_weight_wrapped_to_shrink_the_divisor_fails_the_round() {
        let err = refused(|f, mut input| {
            // The weights' sum lands just above zero weight: the mean is divided by ~0.002.
            let task = f.task.unwrap();
            let q = task.quantizer();
            let others: u64 = SURVIVORS
                .filter(|&d| d != 3)
                .map(|d| u64::from(*f.encoded(d).last().unwrap()))
                .sum();
            let target = q.max_sum(8) / 2 + q.max_sum(8) / 4000;
            *input.last_mut().unwrap() = (target.wrapping_sub(others)) as u32;
            input
        });
        assert!(err.to_string().contains("weights add up to less"), "{err}");
    }

    #[test]
    fn a_value_outside_the_quantization_range_fails_the_round() {
        let err = refused(|_, mut input| {
            // Eight top levels in one entry: the sum lands above what eight inputs can make.
            input[4] = 1 << 31;
            input
        });
        assert!(err.to_string().contains("outside"), "{err}");
    }

    #[test]
    fn honest_sums_pass_the_check() {
        let (aggregate, closing) = super::run(false);
        assert_eq!(closing.outcome, RoundOutcome::Commit);
        assert_eq!(aggregate.n_updates, 8);
    }
}

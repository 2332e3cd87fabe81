//! One secure-aggregation round inside the run machine: SecAgg+'s server side, the devices'
//! indices, the per-stage deadlines, and the durable [`Record`]s the round is rebuilt from.
//!
//! Event-sourced: every decision that a restarted coordinator must repeat exactly (which
//! devices got which index, which messages reached the protocol, when each stage closed) is a
//! [`Record`], persisted before anything that depends on it is told to a device. Replaying the
//! records in order through the same code rebuilds the same server state, so a coordinator
//! restarted between stages carries on where it stopped.
//!
//! Stages and their deadlines (each stage also ends as soon as everyone expected answered):
//! * AdvertiseKeys: until `stage_timeout` after selection ended;
//! * ShareKeys: `stage_timeout` after AdvertiseKeys closed;
//! * MaskedInputCollection (devices train meanwhile): until the round's reporting deadline, and
//!   at least `stage_timeout` after ShareKeys closed;
//! * ConsistencyCheck (survivors sign the survivor set): `stage_timeout` after
//!   MaskedInputCollection closed;
//! * Unmasking: `stage_timeout` after ConsistencyCheck closed.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::UploadRejection;
use crate::fedavg::{Aggregate, AggregateError, PooledEvaluation};
use crate::ids::{DeviceId, Millis, ModelVersion, RoundIdx, RunId};
use crate::plan::SecureRoundConfig;
use crate::privacy::metrics;
use crate::secagg::{
    self, ClientIdx, ConsistencyRequest, MaskRequest, NeighbourKeys, Quantizer, SecAggError,
    UnmaskRequest,
};
use crate::wire::{SecAggInstruction, SecAggUpload, SecureAggregationTask};

/// A SecAgg+ stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// Devices publish their public keys.
    AdvertiseKeys,
    /// Devices seal shares of their secrets to their neighbours.
    ShareKeys,
    /// Devices send masked inputs.
    MaskedInput,
    /// Survivors sign the survivor set.
    ConsistencyCheck,
    /// Signers send the shares that remove the masks.
    Unmasking,
}

impl Stage {
    fn of(message: &SecAggUpload) -> Stage {
        match message {
            SecAggUpload::AdvertiseKeys(_) => Stage::AdvertiseKeys,
            SecAggUpload::ShareKeys(_) => Stage::ShareKeys,
            SecAggUpload::MaskedInput { .. } => Stage::MaskedInput,
            SecAggUpload::SignSurvivors(_) => Stage::ConsistencyCheck,
            SecAggUpload::Unmask(_) => Stage::Unmasking,
        }
    }

    fn next(self) -> Option<Stage> {
        match self {
            Stage::AdvertiseKeys => Some(Stage::ShareKeys),
            Stage::ShareKeys => Some(Stage::MaskedInput),
            Stage::MaskedInput => Some(Stage::ConsistencyCheck),
            Stage::ConsistencyCheck => Some(Stage::Unmasking),
            Stage::Unmasking => None,
        }
    }
}

/// A durable event of a secure round; the round is rebuilt by replaying them in order.
// Records are made and replayed one at a time: the size of a message is not worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Record {
    /// The round's protocol parameters. (Records from before the public graph also hold the
    /// seed the coordinator drew it from, now ignored.)
    Begin {
        /// Parameters every member agrees on.
        config: secagg::Config,
    },
    /// A device was selected; its index is the number of `Selected` records before it, plus one.
    Selected {
        /// The device.
        device: DeviceId,
    },
    /// A device's message reached the protocol (accepted, or excluding its sender).
    Message {
        /// The sender.
        device: DeviceId,
        /// The message.
        message: SecAggUpload,
    },
    /// A stage closed.
    Closed {
        /// The stage.
        stage: Stage,
        /// When.
        at: Millis,
    },
}

/// Why a secure-aggregation message (or poll) was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SecAggRejection {
    /// The round is not open, not this one, or the device was not selected for it.
    Round(UploadRejection),
    /// The message belongs to another stage than the current one.
    WrongStage(String),
    /// The message is malformed or inconsistent; the device is excluded from the round.
    Invalid(String),
}

/// How a secure round ended without a sum.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct SecureFailure {
    pub stage: Stage,
    pub survivors: u32,
    pub reason: String,
}

/// The server side of one secure round.
pub(super) struct SecureRound {
    settings: SecureRoundConfig,
    config: secagg::Config,
    server: secagg::Server,
    min_quorum: u32,
    model_version: ModelVersion,
    reporting_deadline: Millis,
    /// The stage collecting messages; `None` once the round has an outcome.
    stage: Option<Stage>,
    /// When the previous stage closed (the current stage's clock); `None` for AdvertiseKeys.
    previous_close: Option<Millis>,
    devices: Vec<DeviceId>,
    indices: BTreeMap<DeviceId, ClientIdx>,
    /// Who completed each stage, with a digest of what they sent (a retried request with the
    /// same message is answered again, not counted twice).
    completed: BTreeMap<Stage, BTreeMap<ClientIdx, [u8; 32]>>,
    excluded: BTreeMap<ClientIdx, String>,
    neighbours: BTreeMap<ClientIdx, NeighbourKeys>,
    mask_requests: BTreeMap<ClientIdx, MaskRequest>,
    consistency_request: Option<ConsistencyRequest>,
    unmask_request: Option<UnmaskRequest>,
    outcome: Option<Result<(), SecureFailure>>,
    /// The checked unmasking of a round that ended with a sum, until the machine hands it on.
    sum: Option<SecureSum>,
    /// Records to persist, drained by the machine.
    outbox: Vec<Record>,
}

impl std::fmt::Debug for SecureRound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecureRound")
            .field("config", &self.config)
            .field("stage", &self.stage)
            .field("selected", &self.devices.len())
            .field("excluded", &self.excluded)
            .finish_non_exhaustive()
    }
}

/// How long a device waiting for a stage to close is asked to wait before asking again.
const POLL_MS: i64 = 250;

/// The session id binding every protocol message to one round of one run.
pub fn session_id(run_id: RunId, round_idx: RoundIdx, model_version: ModelVersion) -> [u8; 16] {
    let mut h = Sha256::new();
    h.update(b"starling secagg session v1");
    h.update(run_id.0.to_le_bytes());
    h.update(round_idx.0.to_le_bytes());
    h.update(model_version.0.to_le_bytes());
    h.finalize()[..16].try_into().expect("16 bytes")
}

impl SecureRound {
    /// A round from its `Begin` record.
    pub fn begin(
        settings: SecureRoundConfig,
        config: secagg::Config,
        min_quorum: u32,
        model_version: ModelVersion,
        reporting_deadline: Millis,
    ) -> Result<Self, SecAggError> {
        let server = secagg::Server::new(config)?;
        Ok(SecureRound {
            settings,
            config,
            server,
            min_quorum,
            model_version,
            reporting_deadline,
            stage: Some(Stage::AdvertiseKeys),
            previous_close: None,
            devices: vec![],
            indices: BTreeMap::new(),
            completed: BTreeMap::new(),
            excluded: BTreeMap::new(),
            neighbours: BTreeMap::new(),
            mask_requests: BTreeMap::new(),
            consistency_request: None,
            unmask_request: None,
            outcome: None,
            sum: None,
            outbox: vec![Record::Begin { config }],
        })
    }

    /// The round's config for a `Begin` record of a fresh round.
    pub fn config_for(
        settings: &SecureRoundConfig,
        session: [u8; 16],
        target_selected: u32,
    ) -> secagg::Config {
        secagg::Config {
            session,
            n: target_selected,
            k: settings.k,
            t: settings.t,
            len: settings.vector_len,
        }
    }

    /// Records to persist since the last call.
    pub fn take_records(&mut self) -> Vec<Record> {
        std::mem::take(&mut self.outbox)
    }

    /// Replays a stored record (the `Begin` record built this round).
    pub fn replay(&mut self, record: Record) {
        match record {
            Record::Begin { .. } => {}
            Record::Selected { device } => {
                self.select(device);
            }
            Record::Message { device, message } => {
                let _ = self.receive(device, message);
            }
            Record::Closed { stage, at } => self.close(stage, at),
        }
        self.outbox.clear();
    }

    /// Whether the round has ended (with a sum or a failure).
    pub fn outcome(&self) -> Option<&Result<(), SecureFailure>> {
        self.outcome.as_ref()
    }

    /// The unmasking of a round that ended with a sum, once (the machine hands it to the
    /// driver, which does the model-sized work off its task).
    pub fn take_sum(&mut self) -> Option<SecureSum> {
        self.sum.take()
    }

    /// Devices whose masked input is in.
    pub fn n_masked(&self) -> u32 {
        self.count(Stage::MaskedInput) as u32
    }

    /// The devices whose masked input is in (and, once MaskedInputCollection closed, counts:
    /// a device a neighbour could not open shares from is left out).
    pub fn masked_devices(&self) -> impl Iterator<Item = DeviceId> + '_ {
        let counted = match &self.consistency_request {
            Some(r) => r.survivors.clone(),
            None => self.done(Stage::MaskedInput),
        };
        counted.into_iter().map(|i| self.devices[i as usize - 1])
    }

    /// Gives a newly selected device its index.
    pub fn select(&mut self, device: DeviceId) -> ClientIdx {
        if let Some(&i) = self.indices.get(&device) {
            return i;
        }
        self.devices.push(device);
        let idx = self.devices.len() as ClientIdx;
        self.indices.insert(device, idx);
        self.outbox.push(Record::Selected { device });
        idx
    }

    /// What a selected device is told with its task.
    pub fn task(&self, device: DeviceId) -> Option<SecureAggregationTask> {
        Some(SecureAggregationTask {
            config: self.config,
            index: *self.indices.get(&device)?,
            clip: self.settings.clip,
            max_examples: self.settings.max_examples,
            clip_norm: self.settings.clip_norm,
            distributed_noise: self.settings.distributed,
            evaluation_loss_cap: self.settings.evaluation_loss_cap,
        })
    }

    fn done(&self, stage: Stage) -> BTreeSet<ClientIdx> {
        self.completed.get(&stage).map(|m| m.keys().copied().collect()).unwrap_or_default()
    }

    /// How many devices completed `stage`.
    fn count(&self, stage: Stage) -> usize {
        self.completed.get(&stage).map_or(0, BTreeMap::len)
    }

    /// A device's message for the current stage.
    pub fn receive(
        &mut self,
        device: DeviceId,
        message: SecAggUpload,
    ) -> Result<(), SecAggRejection> {
        let Some(&idx) = self.indices.get(&device) else {
            return Err(SecAggRejection::Invalid("the device is not in this round".into()));
        };
        let stage = Stage::of(&message);
        let digest: [u8; 32] =
            Sha256::digest(crate::codec::to_vec(&message).expect("encodes")).into();
        if let Some(previous) = self.completed.get(&stage).and_then(|m| m.get(&idx)) {
            return if *previous == digest {
                Ok(())
            } else {
                Err(SecAggRejection::Invalid(format!(
                    "a different {stage:?} message was already accepted"
                )))
            };
        }
        if let Some(why) = self.excluded.get(&idx) {
            return Err(SecAggRejection::Invalid(format!("excluded from the round: {why}")));
        }
        if self.stage != Some(stage) {
            return Err(SecAggRejection::WrongStage(match self.stage {
                Some(current) => format!("the round is in {current:?}, not {stage:?}"),
                None => "the round's secure aggregation has ended".into(),
            }));
        }
        if let SecAggUpload::MaskedInput { model_version, .. } = &message
            && *model_version != self.model_version
        {
            return Err(SecAggRejection::Invalid(format!(
                "the input was computed on model version {}, the round trains {}",
                model_version.0, self.model_version.0
            )));
        }
        self.outbox.push(Record::Message { device, message: message.clone() });
        let res = match message {
            SecAggUpload::AdvertiseKeys(keys) => self.server.receive_keys(idx, keys),
            SecAggUpload::ShareKeys(shares) => self.server.receive_shares(idx, shares),
            SecAggUpload::MaskedInput { masked, accusations, .. } => {
                if masked.len() != self.config.len * 4 {
                    Err(SecAggError::BadMessage {
                        client: idx,
                        why: format!(
                            "{} bytes, the round's vectors are {} u32",
                            masked.len(),
                            self.config.len
                        ),
                    })
                } else {
                    self.server.receive_masked(idx, ring_elements(&masked), &accusations)
                }
            }
            SecAggUpload::SignSurvivors(signature) => self.server.receive_signature(idx, signature),
            SecAggUpload::Unmask(response) => self.server.receive_unmask(idx, response),
        };
        match res {
            Ok(()) => {
                self.completed.entry(stage).or_default().insert(idx, digest);
                Ok(())
            }
            Err(e) => {
                let why = e.to_string();
                self.excluded.insert(idx, why.clone());
                Err(SecAggRejection::Invalid(why))
            }
        }
    }

    /// What `device` should do now.
    pub fn instruction(&self, device: DeviceId, now: Millis) -> SecAggInstruction {
        let Some(&idx) = self.indices.get(&device) else {
            return excluded("the device is not in this round");
        };
        if let Some(why) = self.excluded.get(&idx) {
            return excluded(why);
        }
        let wait = || SecAggInstruction::Wait {
            retry_after_ms: self.deadline().map_or(POLL_MS, |d| (d - now).clamp(1, POLL_MS)) as u32,
        };
        let did = |stage: Stage| self.completed.get(&stage).is_some_and(|m| m.contains_key(&idx));
        match self.stage {
            Some(Stage::AdvertiseKeys) => wait(),
            Some(Stage::ShareKeys) if did(Stage::ShareKeys) => wait(),
            Some(Stage::ShareKeys) => match self.neighbours.get(&idx) {
                Some(n) => SecAggInstruction::ShareKeys(n.clone()),
                None => excluded("missed AdvertiseKeys"),
            },
            Some(Stage::MaskedInput) if did(Stage::MaskedInput) => wait(),
            Some(Stage::MaskedInput) => match self.mask_requests.get(&idx) {
                Some(r) => SecAggInstruction::MaskedInput(r.clone()),
                None => excluded("missed ShareKeys"),
            },
            Some(Stage::ConsistencyCheck) if did(Stage::ConsistencyCheck) => wait(),
            Some(Stage::ConsistencyCheck) => match &self.consistency_request {
                Some(r) if r.survivors.contains(&idx) => {
                    SecAggInstruction::SignSurvivors(r.clone())
                }
                _ => excluded("missed MaskedInputCollection"),
            },
            Some(Stage::Unmasking) if did(Stage::Unmasking) => SecAggInstruction::Done,
            Some(Stage::Unmasking) => match &self.unmask_request {
                Some(r) if r.signatures.contains_key(&idx) => match self.neighbours.get(&idx) {
                    Some(n) => SecAggInstruction::Unmask(r.for_client(idx, n)),
                    None => excluded("missed AdvertiseKeys"),
                },
                _ => excluded("did not sign the survivor set in time"),
            },
            None => match &self.outcome {
                Some(Ok(_)) if did(Stage::Unmasking) => SecAggInstruction::Done,
                Some(Err(f)) => excluded(&format!("the round failed: {}", f.reason)),
                _ => excluded("missed a stage"),
            },
        }
    }

    /// When the current stage closes at the latest (`None` for AdvertiseKeys until selection
    /// has ended, and once the round has an outcome).
    pub fn deadline(&self) -> Option<Millis> {
        let timeout = self.settings.stage_timeout_ms;
        match self.stage? {
            Stage::MaskedInput => Some(self.reporting_deadline.max(self.previous_close? + timeout)),
            _ => Some(self.previous_close? + timeout),
        }
    }

    /// Closes stages whose deadline passed or whose expected messages are all in.
    /// `selection_ended` is when selection ended, once it has.
    pub fn progress(&mut self, now: Millis, selection_ended: Option<Millis>) {
        if self.stage == Some(Stage::AdvertiseKeys) && self.previous_close.is_none() {
            // AdvertiseKeys's clock starts when selection ends.
            match selection_ended {
                Some(at) => self.previous_close = Some(at),
                None => return,
            }
        }
        while let Some(stage) = self.stage {
            let expected = match stage {
                Stage::AdvertiseKeys => self.devices.len(),
                Stage::ShareKeys => self.neighbours.len(),
                Stage::MaskedInput => self.mask_requests.len(),
                Stage::ConsistencyCheck => {
                    self.consistency_request.as_ref().map_or(0, |r| r.survivors.len())
                }
                Stage::Unmasking => self.unmask_request.as_ref().map_or(0, |r| r.signatures.len()),
            };
            let answered = self.count(stage)
                + self.excluded.keys().filter(|i| self.expected_in(stage, **i)).count();
            let due = self.deadline().is_some_and(|d| now >= d);
            if !(due || answered >= expected) {
                return;
            }
            self.close(stage, now);
            self.outbox.push(Record::Closed { stage, at: now });
        }
    }

    /// Whether `idx` was expected to send a message in `stage`.
    fn expected_in(&self, stage: Stage, idx: ClientIdx) -> bool {
        match stage {
            Stage::AdvertiseKeys => true,
            Stage::ShareKeys => self.neighbours.contains_key(&idx),
            Stage::MaskedInput => self.mask_requests.contains_key(&idx),
            Stage::ConsistencyCheck => {
                self.consistency_request.as_ref().is_some_and(|r| r.survivors.contains(&idx))
            }
            Stage::Unmasking => {
                self.unmask_request.as_ref().is_some_and(|r| r.signatures.contains_key(&idx))
            }
        }
    }

    fn close(&mut self, stage: Stage, at: Millis) {
        if self.stage != Some(stage) {
            return;
        }
        self.previous_close = Some(at);
        self.stage = stage.next();
        let res = match stage {
            Stage::AdvertiseKeys => self.server.close_advertise().map(|n| self.neighbours = n),
            Stage::ShareKeys => self.server.close_share_keys().map(|m| self.mask_requests = m),
            Stage::MaskedInput => self.server.close_masked().and_then(|r| {
                let survivors = r.survivors.len() as u32;
                for idx in self.server.accused() {
                    self.excluded.entry(idx).or_insert_with(|| {
                        "a neighbour could not open the shares this device sealed".into()
                    });
                }
                self.consistency_request = Some(r);
                if survivors < self.min_quorum {
                    return Err(SecAggError::BelowThreshold {
                        stage: "MaskedInputCollection (quorum)",
                        have: survivors as usize,
                        need: self.min_quorum as usize,
                    });
                }
                Ok(())
            }),
            Stage::ConsistencyCheck => {
                self.server.close_consistency().map(|r| self.unmask_request = Some(r))
            }
            Stage::Unmasking => self.finish(),
        };
        if let Err(e) = res {
            self.stage = None;
            self.outcome = Some(Err(SecureFailure {
                stage,
                survivors: self.n_masked(),
                reason: e.to_string(),
            }));
        }
    }

    /// Rebuilds and checks every secret the sum needs; the sum itself is left to
    /// [`SecureSum::finish`].
    fn finish(&mut self) -> Result<(), SecAggError> {
        let unmasking = self.server.finish()?;
        let withdrawn =
            unmasking.withdrawn().iter().map(|&i| (self.devices[i as usize - 1], i)).collect();
        let inconsistent =
            unmasking.inconsistent().iter().map(|&i| self.devices[i as usize - 1]).collect();
        self.sum = Some(SecureSum {
            session: self.config.session,
            unmasking: Arc::new(unmasking),
            withdrawn,
            inconsistent,
            settings: self.settings,
            cohort: self.config.n,
        });
        self.outcome = Some(Ok(()));
        Ok(())
    }
}

/// A masked input's little-endian bytes as ring elements.
fn ring_elements(bytes: &[u8]) -> Vec<u32> {
    bytes.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))).collect()
}

/// A secure round that ended with a sum: the running sum of masked inputs and the masks to
/// remove, checked, and how to decode the result. What is left is model-sized work (expanding
/// one keystream per mask, decoding), which [`SecureSum::finish`] does wherever the driver
/// runs it: never on the task that drives every run.
#[derive(Debug, Clone, PartialEq)]
pub struct SecureSum {
    /// The round's session (with distributed noise, the rotation's seed comes from it).
    session: [u8; 16],
    unmasking: Arc<secagg::Unmasking>,
    /// Devices whose masked input must come back out of the running sum, with their indices.
    withdrawn: BTreeMap<DeviceId, ClientIdx>,
    /// Survivors that returned a wrong share in Unmasking (left out of the rebuild).
    inconsistent: Vec<DeviceId>,
    settings: SecureRoundConfig,
    /// The round's cohort (the quantizer's headroom is sized for it).
    cohort: u32,
}

impl SecureSum {
    /// Devices whose inputs are in the sum.
    pub fn survivors(&self) -> u32 {
        self.unmasking.survivors().len() as u32
    }

    /// Refuses an unmasked sum that `count` honest inputs cannot make. Each entry of an honest
    /// input is a level of the plan's quantizer, so no entry of the sum is above `count` top
    /// levels; and each honest weight entry encodes a weight of at least one example in
    /// `max_examples`, so the weights add up to at least `count` such (exactly `count` top
    /// levels when every update weighs one, as with DP). A device that masks ring elements of
    /// its own choosing (a wrapped weight that shrinks the divisor, a value far outside the
    /// clip) is caught here and the round fails; within the ranges, its influence is that of
    /// an input at the clip's bounds.
    fn check_plausible(
        &self,
        q: &Quantizer,
        sum: &[u32],
        count: u32,
    ) -> Result<(), AggregateError> {
        let most = q.max_sum(count);
        if let Some(j) = sum.iter().position(|&s| u64::from(s) > most) {
            return Err(AggregateError::Secure(format!(
                "entry {j} of the unmasked sum is more than {count} inputs inside the quantization range add up to: a device masked values outside it"
            )));
        }
        let lightest = q.quantize(q.clip / self.settings.max_examples.max(1) as f64);
        let weights = sum.get(self.settings.n_params).map_or(0, |&w| u64::from(w));
        if weights < u64::from(count) * u64::from(lightest) {
            return Err(AggregateError::Secure(format!(
                "the unmasked weights add up to less than {count} devices' of at least one example in {}: a device masked a weight outside its range",
                self.settings.max_examples
            )));
        }
        Ok(())
    }

    /// Survivors that returned a share of another's secret off its polynomial in Unmasking:
    /// found among spare shares and left out, so the sum is right. The coordinator names them.
    pub fn inconsistent_sharers(&self) -> &[DeviceId] {
        &self.inconsistent
    }

    /// Devices whose masked input is in the running sum but not in the result: a neighbour
    /// could not open their shares. [`SecureSum::finish`] needs their masked vectors back,
    /// which the round's records hold ([`SecureSum::withdrawn_input`]); honest rounds have none.
    pub fn withdrawn_devices(&self) -> impl Iterator<Item = DeviceId> + '_ {
        self.withdrawn.keys().copied()
    }

    /// The masked vector in `record`, when it is a withdrawn device's masked input.
    pub fn withdrawn_input(&self, record: &Record) -> Option<(DeviceId, Vec<u32>)> {
        match record {
            Record::Message { device, message: SecAggUpload::MaskedInput { masked, .. } }
                if self.withdrawn.contains_key(device) =>
            {
                Some((*device, ring_elements(masked)))
            }
            _ => None,
        }
    }

    /// The survivors' weighted mean delta and, when the vectors carry evaluations and anyone
    /// evaluated, their pooled evaluation of the round's model. `withdrawn` holds the masked
    /// vector of each of [`SecureSum::withdrawn_devices`].
    pub fn finish(
        &self,
        withdrawn: &BTreeMap<DeviceId, Vec<u32>>,
    ) -> Result<(Aggregate, Option<PooledEvaluation>), AggregateError> {
        let by_index: BTreeMap<ClientIdx, DeviceId> =
            self.withdrawn.iter().map(|(&d, &i)| (i, d)).collect();
        let sum = self
            .unmasking
            .sum(|i| withdrawn.get(by_index.get(&i)?).cloned())
            .map_err(|e| AggregateError::Secure(e.to_string()))?;
        let count = self.survivors();
        if let Some(noise) = &self.settings.distributed {
            return self.finish_distributed(noise, &sum, count);
        }
        let q = Quantizer::for_cohort(self.settings.clip, self.cohort);
        self.check_plausible(&q, &sum, count)?;
        let (model_part, evaluation) = if self.settings.carries_evaluation(sum.len()) {
            sum.split_at(self.settings.n_params + 1)
        } else {
            (&sum[..], &[][..])
        };
        let max_examples = self.settings.max_examples;
        let loss_cap = self.settings.evaluation_loss_cap();
        // A DP round's pooled evaluation is not released as it is: its sums go on as the
        // metrics block, which the run noises if its plan says so and drops otherwise.
        let (metrics, evaluation) = if self.settings.clip_norm.is_some() {
            let block = secagg::evaluation_sums(&q, evaluation, count).map(|sums| {
                let names = [metrics::EVALUATED, metrics::ACCURACY, metrics::EVAL_LOSS];
                names.iter().zip(sums).map(|(n, s)| (n.to_string(), s / f64::from(count))).collect()
            });
            (block.unwrap_or_default(), None)
        } else {
            let pooled = secagg::decode_evaluation(&q, evaluation, count, max_examples, loss_cap)
                .map(|(examples, accuracy, loss)| PooledEvaluation {
                    n_devices: u64::from(count),
                    example_count: examples.round() as u64,
                    metrics: [("accuracy".to_owned(), accuracy), ("loss".to_owned(), loss)].into(),
                });
            (BTreeMap::new(), pooled)
        };
        let mean_delta = secagg::decode_weighted_mean(&q, model_part, count)
            .ok_or(AggregateError::ZeroWeight)?;
        let weight = q.dequantize_sum(*model_part.last().expect("len ≥ 1"), count) / q.clip;
        let aggregate = Aggregate {
            mean_delta,
            total_weight: (weight * self.settings.max_examples as f64).round() as u64,
            n_updates: u64::from(count),
            n_within_bound: u64::from(count),
            metrics,
        };
        Ok((aggregate, evaluation))
    }

    /// A distributed-DP round's mean: the survivors' noisy sum decoded (it carries the noise of
    /// at least `min_survivors` devices: the coordinator adds none) over their count, after the
    /// sum is checked against what honest contributions can make. No evaluation travels.
    fn finish_distributed(
        &self,
        noise: &crate::privacy::DistributedNoise,
        sum: &[u32],
        count: u32,
    ) -> Result<(Aggregate, Option<PooledEvaluation>), AggregateError> {
        if count < noise.min_survivors {
            return Err(AggregateError::Secure(format!(
                "{count} survivors, fewer than the {} whose noise the guarantee counts on",
                noise.min_survivors
            )));
        }
        noise.check_sum(sum, count).map_err(AggregateError::Secure)?;
        let rotation = crate::privacy::distributed::rotation_seed(&self.session);
        let n = f64::from(count);
        let mean_delta = noise.decode_sum(sum, &rotation).into_iter().map(|v| v / n).collect();
        let aggregate = Aggregate {
            mean_delta,
            total_weight: u64::from(count),
            n_updates: u64::from(count),
            n_within_bound: u64::from(count),
            metrics: BTreeMap::new(),
        };
        Ok((aggregate, None))
    }
}

fn excluded(why: &str) -> SecAggInstruction {
    SecAggInstruction::Excluded { reason: why.to_owned() }
}

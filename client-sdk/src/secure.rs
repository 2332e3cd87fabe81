//! A device's side of a secure round: SecAgg+'s client state machine from `core`, driven
//! through the stages over the fleet API, with secrets drawn from the OS.
//!
//! The device advertises its keys (signed with its enrolled identity) as soon as it is selected
//! and seals its shares before it trains (those stages are short); its masked input follows
//! training, and its signature over the survivor set and then its unmasking shares follow the
//! cohort's masked inputs. The coordinator only ever sees the masked vector.

use std::time::Duration;

use starling_core::privacy::distributed;
use starling_core::secagg::{self, SecAggError};
use starling_core::wire::{SecAggInstruction, SecAggUpload, SecureAggregationTask};
use starling_core::{ModelVersion, RoundIdx, RunId};

use crate::protocol::{ClientError, FleetClient, retrying};

/// Attempts per request on transient failures.
const TRIES: u32 = 6;

/// Why a device's part in a secure round ended early.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SecureError {
    /// The coordinator refused or could not be reached.
    #[error(transparent)]
    Protocol(#[from] ClientError),
    /// The round goes on without this device (it missed a stage), or failed.
    #[error("excluded from the secure round: {0}")]
    Excluded(String),
    /// The coordinator's message does not fit the protocol (e.g. a neighbourhood that leaves
    /// too few neighbours); nothing secret was sent.
    #[error("secure aggregation: {0}")]
    Secagg(#[from] SecAggError),
    /// The device has no identity key to sign its keys with: it enrolled before identities, or
    /// was given a credential alone. Enrolling it again registers one.
    #[error("this device has no identity key, which secure runs need: enroll it again")]
    NoIdentity,
    /// The coordinator asked for another stage than the one this device is in.
    #[error("the coordinator asked for {got} while the device waited for {want}")]
    OutOfStep {
        /// What the device waited for.
        want: &'static str,
        /// What it was asked.
        got: String,
    },
}

/// One device in one secure round.
pub struct SecureSession {
    run_id: RunId,
    round_idx: RoundIdx,
    task: SecureAggregationTask,
    client: secagg::Client,
}

impl std::fmt::Debug for SecureSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecureSession")
            .field("run_id", &self.run_id)
            .field("round_idx", &self.round_idx)
            .field("index", &self.task.index)
            .finish_non_exhaustive()
    }
}

impl SecureSession {
    /// AdvertiseKeys: draws this round's secrets from the OS and publishes the public keys,
    /// signed with the device's enrolled identity.
    pub async fn advertise(
        fleet: &FleetClient,
        run_id: RunId,
        round_idx: RoundIdx,
        task: SecureAggregationTask,
    ) -> Result<Self, SecureError> {
        let identity = fleet.identity().cloned().ok_or(SecureError::NoIdentity)?;
        let mut randomness = [0u8; 96];
        getrandom::fill(&mut randomness).expect("the OS random source failed");
        let (mut client, keys) =
            secagg::Client::new(task.index, task.config, identity, randomness)?;
        // This device's noise counts on the sum of at least `min_survivors` devices' noise: it
        // helps unmask no smaller sum.
        if let Some(noise) = &task.distributed_noise {
            client.require_survivors(noise.min_survivors);
        }
        let session = SecureSession { run_id, round_idx, task, client };
        session.send(fleet, SecAggUpload::AdvertiseKeys(keys)).await?;
        Ok(session)
    }

    /// The device's index in the round.
    pub fn index(&self) -> secagg::ClientIdx {
        self.task.index
    }

    /// ShareKeys: waits for the neighbours' keys, then sends them sealed shares.
    pub async fn share_keys(&mut self, fleet: &FleetClient) -> Result<(), SecureError> {
        let neighbours = match self.next_instruction(fleet, "ShareKeys").await? {
            SecAggInstruction::ShareKeys(n) => n,
            other => return Err(out_of_step("ShareKeys", &other)),
        };
        let sealed = self.client.share_keys(neighbours)?;
        self.send(fleet, SecAggUpload::ShareKeys(sealed)).await
    }

    /// MaskedInputCollection: waits for the neighbours' sealed shares, then sends the masked,
    /// quantized, example-weighted `delta`, and with it this device's `evaluation` of the
    /// round's model when the round's vectors carry evaluations (the coordinator learns only
    /// the cohort's pooled evaluation). Neighbours whose shares did not open are accused, with
    /// the evidence the coordinator checks before it leaves them out of the sum.
    pub async fn send_masked(
        &mut self,
        fleet: &FleetClient,
        model_version: ModelVersion,
        delta: &[f32],
        example_count: u64,
        evaluation: Option<secagg::EvaluationInput>,
    ) -> Result<(), SecureError> {
        let request = match self.next_instruction(fleet, "MaskedInput").await? {
            SecAggInstruction::MaskedInput(r) => r,
            other => return Err(out_of_step("MaskedInput", &other)),
        };
        let task = self.task;
        let input = match &task.distributed_noise {
            // Distributed DP: clipped, rotated, rounded and noised here; the coordinator only
            // ever unmasks the cohort's noisy sum.
            Some(noise) => {
                let mut seed = [0u8; 32];
                getrandom::fill(&mut seed).expect("the OS random source failed");
                let rotation = distributed::rotation_seed(&task.config.session);
                noise.encode(delta, &rotation, &mut distributed::NoiseSource::new(seed))
            }
            None => {
                let q = task.quantizer();
                // A differentially private round bounds each device's contribution before
                // masking.
                let clipped =
                    task.clip_norm.map(|bound| starling_core::robust::clip_to_norm(delta, bound));
                let delta = clipped.as_deref().unwrap_or(delta);
                let mut input =
                    secagg::encode_weighted(&q, delta, example_count, task.max_examples);
                if task.config.len == input.len() + secagg::EVALUATION_ENTRIES {
                    secagg::append_evaluation(
                        &q,
                        &mut input,
                        evaluation,
                        task.max_examples,
                        task.evaluation_loss_cap(),
                    );
                }
                input
            }
        };
        let masked = self.client.masked_input(request, &input)?;
        let masked = masked.iter().flat_map(|v| v.to_le_bytes()).collect();
        let accusations = self.client.accusations();
        if !accusations.is_empty() {
            let accused: Vec<_> = accusations.iter().map(|a| a.accused).collect();
            tracing::warn!(run = %self.run_id, round = %self.round_idx, ?accused, "sealed shares from these neighbours did not open");
        }
        self.send(fleet, SecAggUpload::MaskedInput { model_version, masked, accusations }).await
    }

    /// ConsistencyCheck and Unmasking: waits for the survivor set and signs it, then waits for
    /// the survivors' signatures over it and, once at least the threshold of its neighbourhood
    /// signed the same set, sends the shares that remove the masks. A coordinator that shows
    /// this device a set the others did not sign gets no shares.
    pub async fn unmask(&mut self, fleet: &FleetClient) -> Result<(), SecureError> {
        let check = match self.next_instruction(fleet, "SignSurvivors").await? {
            SecAggInstruction::SignSurvivors(r) => r,
            other => return Err(out_of_step("SignSurvivors", &other)),
        };
        let signature = self.client.sign_survivors(check)?;
        self.send(fleet, SecAggUpload::SignSurvivors(signature)).await?;
        let request = match self.next_instruction(fleet, "Unmask").await? {
            SecAggInstruction::Unmask(r) => r,
            other => return Err(out_of_step("Unmask", &other)),
        };
        let response = self.client.unmask(request)?;
        self.send(fleet, SecAggUpload::Unmask(response)).await
    }

    async fn send(&self, fleet: &FleetClient, message: SecAggUpload) -> Result<(), SecureError> {
        let (run, round) = (self.run_id, self.round_idx);
        // A retried message whose first attempt landed is answered again, not counted twice.
        retrying(TRIES, || fleet.secagg_send(run, round, &message)).await?;
        Ok(())
    }

    /// Polls until the coordinator has something other than "wait" for this device.
    async fn next_instruction(
        &self,
        fleet: &FleetClient,
        want: &'static str,
    ) -> Result<SecAggInstruction, SecureError> {
        let (run, round) = (self.run_id, self.round_idx);
        loop {
            match retrying(TRIES, || fleet.secagg_instruction(run, round)).await? {
                SecAggInstruction::Wait { retry_after_ms } => {
                    tokio::time::sleep(Duration::from_millis(u64::from(retry_after_ms.max(10))))
                        .await;
                }
                SecAggInstruction::Excluded { reason } => {
                    return Err(SecureError::Excluded(reason));
                }
                SecAggInstruction::Done => {
                    return Err(SecureError::OutOfStep { want, got: "done".into() });
                }
                other => return Ok(other),
            }
        }
    }
}

fn out_of_step(want: &'static str, got: &SecAggInstruction) -> SecureError {
    let got = match got {
        SecAggInstruction::Wait { .. } => "wait",
        SecAggInstruction::ShareKeys(_) => "ShareKeys",
        SecAggInstruction::MaskedInput(_) => "MaskedInput",
        SecAggInstruction::SignSurvivors(_) => "SignSurvivors",
        SecAggInstruction::Unmask(_) => "Unmask",
        SecAggInstruction::Done => "done",
        SecAggInstruction::Excluded { .. } => "excluded",
    };
    SecureError::OutOfStep { want, got: got.into() }
}

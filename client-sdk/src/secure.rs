//! A device's side of a secure round on its own: core's `SecureParticipation` (what the
//! participation machine uses) driven through the stages over the fleet API, with secrets
//! drawn from the OS. The secure-round benchmark drives devices this way.
//!
//! The device advertises its keys (signed with its enrolled identity) as soon as it is selected
//! and seals its shares before it trains (those stages are short); its masked input follows
//! training, and its signature over the survivor set and then its unmasking shares follow the
//! cohort's masked inputs. The coordinator only ever sees the masked vector.

use std::time::Duration;

use starling_core::participation::{Entropy, SecureFailure, SecureParticipation, stage_name};
use starling_core::secagg::{self, SecAggError};
use starling_core::wire::{SecAggInstruction, SecAggUpload, SecureAggregationTask};
use starling_core::{ModelVersion, RoundIdx, RunId};

use crate::protocol::{ClientError, FleetClient, retrying};

/// Attempts per request on transient failures.
pub(crate) const TRIES: u32 = 6;

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
    /// This device could not go on: the coordinator's message does not fit the protocol, it
    /// asked for another stage, or the device has no identity key (the same reasons the
    /// participation machine gives; nothing secret was sent).
    #[error(transparent)]
    Device(#[from] SecureFailure),
}

impl From<SecAggError> for SecureError {
    fn from(e: SecAggError) -> Self {
        SecureError::Device(SecureFailure::Secagg(e))
    }
}

/// One device in one secure round.
pub struct SecureSession {
    run_id: RunId,
    round_idx: RoundIdx,
    session: SecureParticipation,
}

impl std::fmt::Debug for SecureSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecureSession")
            .field("run_id", &self.run_id)
            .field("round_idx", &self.round_idx)
            .field("index", &self.session.index())
            .finish_non_exhaustive()
    }
}

impl SecureSession {
    /// AdvertiseKeys for the task of `round_idx` of `run_id` at `model_version`: draws this
    /// round's secrets from the OS and publishes the public keys, signed with the device's
    /// enrolled identity (with its enrolment certificate, and requiring its neighbours', as the
    /// client's [`Enrolment`](starling_core::participation::Enrolment) says).
    pub async fn advertise(
        fleet: &FleetClient,
        run_id: RunId,
        (round_idx, model_version): (RoundIdx, ModelVersion),
        task: SecureAggregationTask,
    ) -> Result<Self, SecureError> {
        let identity = fleet.identity().cloned().ok_or(SecureFailure::NoIdentity)?;
        let mut entropy = Entropy { keys: [0; 96], noise: [0; 32] };
        getrandom::fill(&mut entropy.keys).expect("the OS random source failed");
        getrandom::fill(&mut entropy.noise).expect("the OS random source failed");
        let round = (run_id, round_idx, model_version);
        let (session, keys) =
            SecureParticipation::advertise(round, task, identity, fleet.enrolment(), entropy)?;
        let session = SecureSession { run_id, round_idx, session };
        session.send(fleet, keys).await?;
        Ok(session)
    }

    /// The device's index in the round.
    pub fn index(&self) -> secagg::ClientIdx {
        self.session.index()
    }

    /// ShareKeys: waits for the neighbours' keys, then sends them sealed shares.
    pub async fn share_keys(&mut self, fleet: &FleetClient) -> Result<(), SecureError> {
        let neighbours = match self.next_instruction(fleet, "ShareKeys").await? {
            SecAggInstruction::ShareKeys(n) => n,
            other => return Err(out_of_step("ShareKeys", &other)),
        };
        let sealed = self.session.share_keys(neighbours)?;
        self.send(fleet, sealed).await
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
        let (masked, accused) =
            self.session.masked_input(request, model_version, delta, example_count, evaluation)?;
        if !accused.is_empty() {
            tracing::warn!(run = %self.run_id, round = %self.round_idx, ?accused, "sealed shares from these neighbours did not open");
        }
        self.send(fleet, masked).await
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
        let signature = self.session.sign_survivors(check)?;
        self.send(fleet, signature).await?;
        let request = match self.next_instruction(fleet, "Unmask").await? {
            SecAggInstruction::Unmask(r) => r,
            other => return Err(out_of_step("Unmask", &other)),
        };
        let response = self.session.unmask(request)?;
        self.send(fleet, response).await
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
                    return Err(SecureFailure::OutOfStep { want, got: "done" }.into());
                }
                other => return Ok(other),
            }
        }
    }
}

fn out_of_step(want: &'static str, got: &SecAggInstruction) -> SecureError {
    SecureFailure::OutOfStep { want, got: stage_name(got) }.into()
}

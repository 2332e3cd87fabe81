//! A device's side of one secure round, without IO: SecAgg+'s client with the round's task,
//! turning each instruction the coordinator gives into the message the device sends. The
//! participation machine drives it; so does the SDK's `SecureSession` for the secure-round
//! benchmark, so both encode, clip, noise and mask a device's input the same way.

use super::Enrolment;
use crate::privacy::distributed;
use crate::round::secure::session_id;
use crate::secagg::{
    self, Accusation, ClientIdx, ConsistencyRequest, DeviceIdentity, EvaluationInput, MaskRequest,
    NeighbourKeys, SecAggError, UnmaskRequest,
};
use crate::wire::{SecAggInstruction, SecAggUpload, SecureAggregationTask};
use crate::{ModelVersion, RoundIdx, RunId};

/// One device in one secure round.
pub struct SecureParticipation {
    task: SecureAggregationTask,
    client: secagg::Client,
    /// Seeds the distributed-DP noise this device adds to its input.
    noise_seed: [u8; 32],
}

impl std::fmt::Debug for SecureParticipation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecureParticipation")
            .field("index", &self.task.index)
            .finish_non_exhaustive()
    }
}

/// The device's randomness for one participation: drawn from the OS by a driver, fixed by a
/// test. Used only in secure rounds.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Entropy {
    /// The round's secrets (see [`secagg::Client::new`]).
    pub keys: [u8; 96],
    /// Seeds the distributed-DP noise.
    pub noise: [u8; 32],
}

impl std::fmt::Debug for Entropy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Entropy(..)")
    }
}

impl SecureParticipation {
    /// AdvertiseKeys for the task of `round` (run, round, model version): this round's secrets
    /// from `entropy`, and the public keys signed with the device's enrolled `identity`, with
    /// its certificate from the operator's enrolment authority when it has one. The session
    /// must be the one every device derives from the round (the coordinator does not choose
    /// it: it orders the ring of neighbours); a device that pins an authority requires its
    /// certificate of every neighbour.
    pub fn advertise(
        round: (RunId, RoundIdx, ModelVersion),
        task: SecureAggregationTask,
        identity: DeviceIdentity,
        enrolment: Enrolment,
        entropy: Entropy,
    ) -> Result<(Self, SecAggUpload), SecAggError> {
        let (run_id, round_idx, model_version) = round;
        if task.config.session != session_id(run_id, round_idx, model_version) {
            return Err(SecAggError::BadMessage {
                client: 0,
                why: "the round's session is not the one derived from its run, round and model version"
                    .into(),
            });
        }
        let (mut client, mut keys) =
            secagg::Client::new(task.index, task.config, identity, entropy.keys)?;
        keys.certificate = enrolment.certificate;
        if let Some(authority) = enrolment.authority {
            client.require_certificates(authority);
        }
        // This device's noise counts on the sum of at least `min_survivors` devices' noise: it
        // helps unmask no smaller sum.
        if let Some(noise) = &task.distributed_noise {
            client.require_survivors(noise.min_survivors);
        }
        let session = SecureParticipation { task, client, noise_seed: entropy.noise };
        Ok((session, SecAggUpload::AdvertiseKeys(keys)))
    }

    /// The device's index in the round.
    pub fn index(&self) -> ClientIdx {
        self.task.index
    }

    /// ShareKeys: sealed shares for the neighbours whose keys the coordinator relayed.
    pub fn share_keys(&mut self, neighbours: NeighbourKeys) -> Result<SecAggUpload, SecAggError> {
        Ok(SecAggUpload::ShareKeys(self.client.share_keys(neighbours)?))
    }

    /// MaskedInputCollection: the masked, quantized, example-weighted `delta` (clipped for a DP
    /// round; clipped, rotated, rounded and noised here for distributed DP), with this device's
    /// `evaluation` when the round's vectors carry evaluations. Neighbours whose shares did not
    /// open are accused in the message, and named in the second value.
    pub fn masked_input(
        &mut self,
        request: MaskRequest,
        model_version: ModelVersion,
        delta: &[f32],
        example_count: u64,
        evaluation: Option<EvaluationInput>,
    ) -> Result<(SecAggUpload, Vec<ClientIdx>), SecAggError> {
        let task = &self.task;
        let input = match &task.distributed_noise {
            // Distributed DP: the coordinator only ever unmasks the cohort's noisy sum.
            Some(noise) => {
                let rotation = distributed::rotation_seed(&task.config.session);
                noise.encode(delta, &rotation, &mut distributed::NoiseSource::new(self.noise_seed))
            }
            None => {
                let q = task.quantizer();
                // A differentially private round bounds each device's contribution before
                // masking.
                let clipped = task.clip_norm.map(|bound| crate::robust::clip_to_norm(delta, bound));
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
        let accusations: Vec<Accusation> = self.client.accusations();
        let accused = accusations.iter().map(|a| a.accused).collect();
        Ok((SecAggUpload::MaskedInput { model_version, masked, accusations }, accused))
    }

    /// ConsistencyCheck: the device's signature over the survivor set it is shown.
    pub fn sign_survivors(
        &mut self,
        request: ConsistencyRequest,
    ) -> Result<SecAggUpload, SecAggError> {
        Ok(SecAggUpload::SignSurvivors(self.client.sign_survivors(request)?))
    }

    /// Unmasking: the shares that remove the masks, once at least the threshold of its
    /// neighbourhood signed the same set (a set the others did not sign gets no shares).
    pub fn unmask(&mut self, request: UnmaskRequest) -> Result<SecAggUpload, SecAggError> {
        Ok(SecAggUpload::Unmask(self.client.unmask(request)?))
    }
}

/// The name of an instruction's stage, as a device that waited for another reports it.
pub fn stage_name(instruction: &SecAggInstruction) -> &'static str {
    match instruction {
        SecAggInstruction::Wait { .. } => "wait",
        SecAggInstruction::ShareKeys(_) => "ShareKeys",
        SecAggInstruction::MaskedInput(_) => "MaskedInput",
        SecAggInstruction::SignSurvivors(_) => "SignSurvivors",
        SecAggInstruction::Unmask(_) => "Unmask",
        SecAggInstruction::Done => "done",
        SecAggInstruction::Excluded { .. } => "excluded",
    }
}

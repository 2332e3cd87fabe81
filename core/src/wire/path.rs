//! The API's paths, in one place: the SDK, the aggregators and the tests build them here, and a
//! test checks every coordinator template against the OpenAPI document the handlers generate,
//! so a client and the server cannot drift apart.
//!
//! Templates are written as axum and the OpenAPI document write them (`{run_id}`); the
//! functions fill them in.

use crate::ids::{DeviceId, RoundIdx, RunId};

/// `POST`: trade an enrollment token for a device credential.
pub const ENROLL: &str = "/v1/enroll";
/// `POST`: ask for a task.
pub const CHECK_IN: &str = "/v1/check-in";
/// `GET`: a model by content hash.
pub const MODEL: &str = "/v1/models/{hash}";
/// `GET`: an imported pretrained model by content hash (a run's frozen tensors).
pub const BASE_MODEL: &str = "/v1/base-models/{hash}";
/// `GET`: an imported tokenizer's `tokenizer.json`, by content hash.
pub const TOKENIZER: &str = "/v1/tokenizers/{hash}";
/// `GET`: the tensors a run trains (the update's and the local ones) of one of its models.
pub const TRAINED_PART: &str = "/v1/runs/{run_id}/models/{hash}/trained";
/// `POST`: a device's update (to the coordinator, or to its aggregator).
pub const UPLOAD: &str = "/v1/runs/{run_id}/rounds/{round_idx}/updates";
/// `POST` a secure round's stage message; `GET` the device's next instruction.
pub const SECAGG: &str = "/v1/runs/{run_id}/rounds/{round_idx}/secagg";
/// `POST`: a device's evaluation of a model version.
pub const EVALUATIONS: &str = "/v1/runs/{run_id}/evaluations";
/// `POST`: an aggregator's liveness and shard list.
pub const AGGREGATOR_POLL: &str = "/v1/aggregation/poll";
/// `POST`: an aggregator's partial aggregate.
pub const PARTIAL: &str = "/v1/aggregation/runs/{run_id}/rounds/{round_idx}/partial";
/// `PUT`/`GET`: an aggregator group's rendezvous.
pub const GROUP: &str = "/v1/aggregation/groups/{group}";
/// `POST` to a group leader (an aggregator, not the coordinator): a member's finished shard.
pub const GROUP_HANDOFF: &str = "/v1/group/runs/{run_id}/rounds/{round_idx}/partial";
/// `POST` to a group leader: a member's offer to sum by NCCL all-reduce.
pub const GROUP_COLLECTIVE: &str = "/v1/group/runs/{run_id}/rounds/{round_idx}/collective";
/// `POST`: an enrollment token.
pub const ADMIN_ENROLLMENT_TOKENS: &str = "/v1/admin/enrollment-tokens";
/// `POST` a run; `GET` every run.
pub const ADMIN_RUNS: &str = "/v1/admin/runs";
/// `GET`: one run.
pub const ADMIN_RUN: &str = "/v1/admin/runs/{run_id}";
/// `GET`: a run's rounds.
pub const ADMIN_ROUNDS: &str = "/v1/admin/runs/{run_id}/rounds";
/// `GET`: one round.
pub const ADMIN_ROUND: &str = "/v1/admin/runs/{run_id}/rounds/{round_idx}";
/// `GET`: who was selected for a round and how their updates arrived.
pub const ADMIN_ROUND_DEVICES: &str = "/v1/admin/runs/{run_id}/rounds/{round_idx}/devices";
/// `GET`: a run's model versions.
pub const ADMIN_MODELS: &str = "/v1/admin/runs/{run_id}/models";
/// `GET`: the model spec a central evaluator builds a run's models from (422 for a run of kind
/// `tensors`, which has none).
pub const ADMIN_MODEL_SPEC: &str = "/v1/admin/runs/{run_id}/model-spec";
/// `GET`: one committed model, as safetensors or the raw payload.
pub const ADMIN_MODEL: &str = "/v1/admin/runs/{run_id}/models/{version}";
/// `POST`: a central evaluator's evaluation of a model version.
pub const ADMIN_MODEL_EVALUATIONS: &str = "/v1/admin/runs/{run_id}/models/{version}/evaluations";
/// `POST` a pretrained model (safetensors); `GET` every imported one.
pub const ADMIN_BASE_MODELS: &str = "/v1/admin/base-models";
/// `POST` a Hugging Face tokenizer (`tokenizer.json`); `GET` every imported one.
pub const ADMIN_TOKENIZERS: &str = "/v1/admin/tokenizers";
/// `POST`: stop a run.
pub const ADMIN_STOP: &str = "/v1/admin/runs/{run_id}/stop";
/// `GET`: every enrolled device.
pub const ADMIN_DEVICES: &str = "/v1/admin/devices";
/// `POST`: revoke a device.
pub const ADMIN_REVOKE: &str = "/v1/admin/devices/{device_id}/revoke";
/// `GET`: the coordinator's Prometheus metrics.
pub const METRICS: &str = "/metrics";
/// `GET`: the live event stream behind the dashboard.
pub const ADMIN_EVENTS: &str = "/v1/admin/events";
/// `GET`: the last hour of device-population samples.
pub const ADMIN_POPULATION: &str = "/v1/admin/population";
/// Liveness probe.
pub const LIVEZ: &str = "/livez";
/// Readiness probe: ready for devices (a leader, or a replica that relays to one).
pub const READYZ: &str = "/readyz";
/// Readiness for everything: 200 only on the leading coordinator (replicas answer 503).
pub const LEADERZ: &str = "/leaderz";
/// The container's health check.
pub const HEALTHZ: &str = "/healthz";

/// Every template the coordinator serves; each is a path of its OpenAPI document.
pub const COORDINATOR: &[&str] = &[
    ENROLL,
    CHECK_IN,
    MODEL,
    BASE_MODEL,
    TOKENIZER,
    TRAINED_PART,
    UPLOAD,
    SECAGG,
    EVALUATIONS,
    AGGREGATOR_POLL,
    PARTIAL,
    GROUP,
    ADMIN_ENROLLMENT_TOKENS,
    ADMIN_RUNS,
    ADMIN_RUN,
    ADMIN_ROUNDS,
    ADMIN_ROUND,
    ADMIN_ROUND_DEVICES,
    ADMIN_MODELS,
    ADMIN_MODEL_SPEC,
    ADMIN_MODEL,
    ADMIN_MODEL_EVALUATIONS,
    ADMIN_BASE_MODELS,
    ADMIN_TOKENIZERS,
    ADMIN_STOP,
    ADMIN_DEVICES,
    ADMIN_REVOKE,
    METRICS,
    ADMIN_EVENTS,
    ADMIN_POPULATION,
    LIVEZ,
    READYZ,
    LEADERZ,
    HEALTHZ,
];

fn run_round(template: &str, run: RunId, round: RoundIdx) -> String {
    template.replace("{run_id}", &run.to_string()).replace("{round_idx}", &round.to_string())
}

fn run(template: &str, run: RunId) -> String {
    template.replace("{run_id}", &run.to_string())
}

/// [`MODEL`].
pub fn model(hash: &str) -> String {
    MODEL.replace("{hash}", hash)
}

/// [`MODEL`] in a download encoding: `?compression=` for any but f32, the plain download.
pub fn model_in(hash: &str, compression: crate::compression::Compression) -> String {
    match compression.is_f32() {
        true => model(hash),
        // `f16`, `bf16` or `int8:BLOCK`: nothing in them needs escaping in a query.
        false => format!("{}?compression={compression}", model(hash)),
    }
}

/// [`BASE_MODEL`] for `hash`.
pub fn base_model(hash: &str) -> String {
    BASE_MODEL.replace("{hash}", hash)
}

/// [`TOKENIZER`] for `hash`.
pub fn tokenizer(hash: &str) -> String {
    TOKENIZER.replace("{hash}", hash)
}

/// [`TRAINED_PART`] of model `hash` of `run`.
pub fn trained_part(run: RunId, hash: &str) -> String {
    TRAINED_PART.replace("{run_id}", &run.0.to_string()).replace("{hash}", hash)
}

/// [`UPLOAD`].
pub fn upload(run: RunId, round: RoundIdx) -> String {
    run_round(UPLOAD, run, round)
}

/// [`SECAGG`].
pub fn secagg(run: RunId, round: RoundIdx) -> String {
    run_round(SECAGG, run, round)
}

/// [`EVALUATIONS`].
pub fn evaluations(run_id: RunId) -> String {
    run(EVALUATIONS, run_id)
}

/// [`PARTIAL`].
pub fn partial(run: RunId, round: RoundIdx) -> String {
    run_round(PARTIAL, run, round)
}

/// [`GROUP`].
pub fn group(name: &str) -> String {
    GROUP.replace("{group}", name)
}

/// [`GROUP_HANDOFF`].
pub fn group_handoff(run: RunId, round: RoundIdx) -> String {
    run_round(GROUP_HANDOFF, run, round)
}

/// [`GROUP_COLLECTIVE`].
pub fn group_collective(run: RunId, round: RoundIdx) -> String {
    run_round(GROUP_COLLECTIVE, run, round)
}

/// [`ADMIN_RUN`].
pub fn admin_run(run_id: RunId) -> String {
    run(ADMIN_RUN, run_id)
}

/// [`ADMIN_ROUNDS`].
pub fn admin_rounds(run_id: RunId) -> String {
    run(ADMIN_ROUNDS, run_id)
}

/// [`ADMIN_ROUND`].
pub fn admin_round(run: RunId, round: RoundIdx) -> String {
    run_round(ADMIN_ROUND, run, round)
}

/// [`ADMIN_ROUND_DEVICES`].
pub fn admin_round_devices(run: RunId, round: RoundIdx) -> String {
    run_round(ADMIN_ROUND_DEVICES, run, round)
}

/// [`ADMIN_MODEL_SPEC`].
pub fn admin_model_spec(run_id: RunId) -> String {
    run(ADMIN_MODEL_SPEC, run_id)
}

/// [`ADMIN_MODELS`].
pub fn admin_models(run_id: RunId) -> String {
    run(ADMIN_MODELS, run_id)
}

/// [`ADMIN_MODEL`].
pub fn admin_model(run_id: RunId, version: i64) -> String {
    run(ADMIN_MODEL, run_id).replace("{version}", &version.to_string())
}

/// [`ADMIN_MODEL_EVALUATIONS`].
pub fn admin_model_evaluations(run_id: RunId, version: i64) -> String {
    run(ADMIN_MODEL_EVALUATIONS, run_id).replace("{version}", &version.to_string())
}

/// [`ADMIN_STOP`].
pub fn admin_stop(run_id: RunId) -> String {
    run(ADMIN_STOP, run_id)
}

/// [`ADMIN_REVOKE`].
pub fn admin_revoke(device: DeviceId) -> String {
    ADMIN_REVOKE.replace("{device_id}", &device.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_fill_in() {
        assert_eq!(upload(RunId(3), RoundIdx(0)), "/v1/runs/3/rounds/0/updates");
        assert_eq!(admin_revoke(DeviceId(9)), "/v1/admin/devices/9/revoke");
        assert_eq!(group("g-1"), "/v1/aggregation/groups/g-1");
        assert!(COORDINATOR.iter().all(|t| t.starts_with('/')));
    }
}

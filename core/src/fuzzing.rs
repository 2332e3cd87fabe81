//! Entry points that feed untrusted bytes to every decoder the coordinator and SDK run on
//! network input. The cargo-fuzz targets in `fuzz/` call them, and so does the regression test
//! over `fuzz/regressions/` on stable Rust in CI: one harness, two drivers.
//!
//! Each function must return normally for every input; a panic, abort or runaway allocation is
//! a bug in the decoder.

use crate::codec;
use crate::compression::Compression;
use crate::fedavg::validate_update;
use crate::plan::Plan;
use crate::tensor::{DType, TensorPayload, TensorSchema, TensorSpec};
use crate::wire::{
    CheckInRequest, CheckInResponse, EnrollRequest, EnrollResponse, ErrorBody, EvaluationReport,
    TaskAssignment, UploadAck, UploadRequest,
};

/// The schema uploads are checked against: two small tensors.
fn round_schema() -> TensorSchema {
    TensorSchema {
        tensors: vec![
            TensorSpec { name: "w".into(), shape: vec![4, 3], dtype: DType::F32 },
            TensorSpec { name: "b".into(), shape: vec![3], dtype: DType::F32 },
        ],
    }
}

/// Every fleet-API message, as the coordinator (requests) and the SDK (answers) decode them;
/// a decoded upload also goes through validation, and what decodes re-encodes to the same value.
pub fn fleet_message(data: &[u8]) {
    let _ = codec::decode::<EnrollRequest>(data);
    let _ = codec::decode::<EnrollResponse>(data);
    let _ = codec::decode::<CheckInRequest>(data);
    let _ = codec::decode::<CheckInResponse>(data);
    let _ = codec::decode::<TaskAssignment>(data);
    let _ = codec::decode::<UploadAck>(data);
    let _ = codec::decode::<EvaluationReport>(data);
    let _ = codec::decode::<ErrorBody>(data);
    if let Ok(upload) = codec::decode::<UploadRequest>(data) {
        let again = codec::to_vec(&upload).expect("a decoded upload encodes");
        assert_eq!(codec::decode::<UploadRequest>(&again).ok().as_ref(), Some(&upload));
        let _ = validate_update(&round_schema(), Compression::F32, upload);
    }
}

/// Tensor payloads and schemas: CBOR-framed, the raw little-endian body a model or delta is
/// stored as, and a delta in every compressed encoding.
pub fn tensor_payload(data: &[u8]) {
    let schema = round_schema();
    if let Ok(payload) = codec::decode::<TensorPayload>(data) {
        let _ = schema.decode_f32(&payload);
    }
    let _ = schema.decode_f32_bytes(data);
    // Compressed deltas, as every encoding a plan may choose decodes them.
    for compression in [
        Compression::F32,
        Compression::F16,
        Compression::Bf16,
        Compression::Int8 { block: 4 },
        Compression::TopK { fraction: 0.5 },
    ] {
        if let Ok(delta) = compression.validate(schema.numel() as usize, data.to_vec()) {
            let _ = delta.norm_squared();
            assert_eq!(delta.to_f32().len() as u64, schema.numel());
        }
    }
    if let Ok(other) = codec::decode::<TensorSchema>(data)
        && other.validate().is_ok()
    {
        let _ = other.schema_id();
        let _ = other.byte_len();
    }
}

/// A run plan as the admin API takes it (JSON), through validation.
pub fn plan_json(data: &[u8]) {
    if let Ok(plan) = serde_json::from_slice::<Plan>(data) {
        let _ = plan.validate();
    }
}

/// Every SecAgg+ message; a decoded client message is also handed to a server in the stage
/// that takes it, and a decoded server message to a client, which must refuse or accept it
/// without panicking.
pub fn secagg_message(data: &[u8]) {
    use crate::secagg::{
        AdvertiseKeys, Client, Config, ConsistencyRequest, DeviceIdentity, MaskRequest,
        NeighbourKeys, SealedShares, Server, UnmaskRequest, UnmaskResponse,
    };
    let identity = |i: u8| DeviceIdentity::from_secret([i; 32]);
    let config = Config { session: [0; 16], n: 4, k: 3, t: 2, len: 4 };
    if let Ok(advert) = codec::decode::<AdvertiseKeys>(data) {
        let mut server = Server::new(config).expect("valid config");
        let _ = server.receive_keys(1, advert);
    }
    if let Ok(neighbours) = codec::decode::<NeighbourKeys>(data) {
        let (mut client, _) = Client::new(1, config, identity(1), [7; 96]).expect("valid config");
        let _ = client.share_keys(neighbours);
    }
    if let Ok(shares) = codec::decode::<Vec<SealedShares>>(data) {
        let mut server = Server::new(config).expect("valid config");
        for i in 1..=4u8 {
            let (_, advert) =
                Client::new(u32::from(i), config, identity(i), [i; 96]).expect("valid config");
            let _ = server.receive_keys(u32::from(i), advert);
        }
        if server.close_advertise().is_ok() {
            let _ = server.receive_shares(1, shares);
        }
    }
    let _ = codec::decode::<MaskRequest>(data);
    let _ = codec::decode::<ConsistencyRequest>(data);
    let _ = codec::decode::<UnmaskRequest>(data);
    let _ = codec::decode::<UnmaskResponse>(data);
    let _ = codec::decode::<crate::wire::SecAggInstruction>(data);
    let _ = codec::decode::<crate::round::secure::Record>(data);
    if let Ok(message) = codec::decode::<crate::wire::SecAggUpload>(data) {
        secure_round_takes(message);
    }
}

/// A secure run with four selected devices takes `message` from device 1, as the fleet API
/// hands it over.
fn secure_round_takes(message: crate::wire::SecAggUpload) {
    use crate::ids::{DeviceId, RoundIdx, RunId};
    use crate::plan::{RoundConfig, SecureRoundConfig};
    use crate::round::{Input, RequestId, RunMachine};
    let config = RoundConfig {
        cohort_size: 4,
        target_selected: 4,
        min_quorum: 3,
        selection_timeout_ms: 1_000,
        reporting_timeout_ms: 5_000,
        total_rounds: 1,
        eligibility: Default::default(),
        evaluation_only: false,
        each_update_direct: false,
        poisson_rate: None,
        min_population: None,
        selection: crate::plan::SelectionPolicy::FirstCome,
        asynchronous: None,
        max_failed_rounds: 0,
        participation_rule: None,
        secure: Some(SecureRoundConfig {
            clip: 1.0,
            max_examples: 10,
            k: 3,
            t: 2,
            n_params: 3,
            clip_norm: None,
            distributed: None,
            evaluation_loss_cap: None,
            vector_len: 4,
            stage_timeout_ms: 1_000,
        }),
    };
    let mut m = RunMachine::start(RunId(1), config, 0, [3; 32]);
    for d in 1..=4 {
        m.handle(
            0,
            Input::CheckIn {
                request: RequestId(d as u64),
                device: DeviceId(d),
                attributes: Default::default(),
                online: 4,
            },
        );
    }
    let round_idx = RoundIdx(0);
    m.handle(1, Input::SecAgg { request: RequestId(9), device: DeviceId(1), round_idx, message });
    m.handle(2, Input::SecAggPoll { request: RequestId(10), device: DeviceId(1), round_idx });
    m.handle_timeout(10_000);
    while m.poll_action().is_some() {}
}

//! The fuzz harnesses (`starling_core::fuzzing`) on stable Rust, as CI runs them: every input
//! cargo-fuzz ever found (`fuzz/regressions/<target>/`), hostile CBOR and JSON written by hand,
//! and random mutations of valid messages. Each must be refused or accepted, never crash.

use starling_core::codec;
use std::collections::BTreeMap;
use std::path::Path;

use proptest::prelude::*;
use starling_core::fuzzing::{fleet_message, plan_json, secagg_message, tensor_payload};
use starling_core::tensor::{DType, TensorSchema, TensorSpec};
use starling_core::wire::{self, CheckInResponse, UploadRequest};
use starling_core::{ModelVersion, RoundIdx, RunId};

type Target = fn(&[u8]);

fn targets() -> [(&'static str, Target); 4] {
    [
        ("fleet_message", fleet_message),
        ("tensor_payload", tensor_payload),
        ("plan_json", plan_json),
        ("secagg_message", secagg_message),
    ]
}

/// Valid messages to mutate from.
fn seeds() -> Vec<Vec<u8>> {
    let schema = TensorSchema {
        tensors: vec![
            TensorSpec { name: "w".into(), shape: vec![4, 3], dtype: DType::F32 },
            TensorSpec { name: "b".into(), shape: vec![3], dtype: DType::F32 },
        ],
    };
    let upload = UploadRequest {
        model_version: ModelVersion(3),
        example_count: 12,
        metrics: BTreeMap::from([("loss".to_owned(), 0.5)]),
        delta: schema.encode_f32(&[0.25; 15]),
    };
    vec![
        codec::to_vec(&upload).unwrap(),
        codec::to_vec(&upload.delta).unwrap(),
        codec::to_vec(&schema).unwrap(),
        codec::to_vec(&CheckInResponse::ComeBackLater { retry_after_secs: 5 }).unwrap(),
        codec::to_vec(&wire::UploadAck { run_id: RunId(1), round_idx: RoundIdx(2) }).unwrap(),
        br#"{"model":{"schema":{"tensors":[{"name":"w","shape":[4],"dtype":"f32"}]},"init":{"kind":"zeros"}},"cohort_size":2,"rounds":1}"#.to_vec(),
    ]
}

#[test]
fn every_found_input_is_handled() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/regressions");
    let mut replayed = 0;
    for (name, target) in targets() {
        let Ok(entries) = std::fs::read_dir(root.join(name)) else { continue };
        for entry in entries {
            let bytes = std::fs::read(entry.unwrap().path()).unwrap();
            target(&bytes);
            replayed += 1;
        }
    }
    println!("replayed {replayed} saved fuzz inputs");
}

#[test]
fn hostile_inputs_are_refused_without_crashing() {
    let mut upload_with_huge_delta = seeds()[0].clone();
    // Replace the delta's byte-string header with one claiming 2^62 bytes.
    let data_at = upload_with_huge_delta.len() - 15 * 4;
    upload_with_huge_delta.truncate(data_at - 2);
    upload_with_huge_delta.extend([0x5b, 0x40, 0, 0, 0, 0, 0, 0, 0]);
    let inputs: Vec<Vec<u8>> = vec![
        // A byte string, a text string, an array and a map claiming 2^64-1 items.
        [&[0x5b][..], &[0xff; 8]].concat(),
        [&[0x7b][..], &[0xff; 8]].concat(),
        [&[0x9b][..], &[0xff; 8]].concat(),
        [&[0xbb][..], &[0xff; 8]].concat(),
        upload_with_huge_delta,
        // Nesting far deeper than any message.
        vec![0x81; 100_000],
        vec![0xa1; 100_000],
        // An indefinite-length string that never ends; a lone break; tags on tags.
        vec![0x5f, 0x41, 0x00, 0x41, 0x00],
        vec![0xff],
        [0xd8, 0x18].repeat(10_000),
        vec![],
        b"[".repeat(100_000),
        br#"{"model":{"schema":{"tensors":[{"name":"w","shape":[4294967296,4294967296],"dtype":"f32"}]},"init":{"kind":"zeros"}},"cohort_size":2,"rounds":1}"#.to_vec(),
    ];
    for input in &inputs {
        for (_, target) in targets() {
            target(input);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2_000, ..ProptestConfig::default() })]

    #[test]
    fn mutated_messages_are_handled(
        seed in 0usize..6,
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..8),
        cut in any::<usize>(),
    ) {
        let mut bytes = seeds()[seed].clone();
        for (at, value) in flips {
            let n = bytes.len();
            bytes[at % n] = value;
        }
        bytes.truncate(cut % (bytes.len() + 1));
        for (_, target) in targets() {
            target(&bytes);
        }
    }

    #[test]
    fn random_bytes_are_handled(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        for (_, target) in targets() {
            target(&bytes);
        }
    }
}

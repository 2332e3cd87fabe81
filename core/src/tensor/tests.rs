//! Schema validation, schema ids and the payload codec, checked on literals.

use super::*;

fn schema() -> TensorSchema {
    TensorSchema {
        tensors: vec![
            TensorSpec { name: "w".into(), shape: vec![2, 3], dtype: DType::F32 },
            TensorSpec { name: "b".into(), shape: vec![2], dtype: DType::F32 },
        ],
    }
}

#[test]
fn schema_id_is_stable_and_sensitive() {
    let s = schema();
    // Pinned: changing the preimage layout would break every stored model and client.
    expect_test::expect!["fdc950c11c3a578c"].assert_eq(&s.schema_id().to_string());
    let mut renamed = s.clone();
    renamed.tensors[1].name = "bias".into();
    assert_ne!(renamed.schema_id(), s.schema_id());
    let mut reshaped = s.clone();
    reshaped.tensors[0].shape = vec![3, 2];
    assert_ne!(reshaped.schema_id(), s.schema_id());
}

#[test]
fn validate_rejects_bad_schemas() {
    assert_eq!(TensorSchema { tensors: vec![] }.validate(), Err(TensorError::EmptySchema));
    let mut dup = schema();
    dup.tensors[1].name = "w".into();
    assert!(matches!(dup.validate(), Err(TensorError::BadName { .. })));
    let mut zero = schema();
    zero.tensors[0].shape = vec![2, 0];
    assert!(matches!(zero.validate(), Err(TensorError::BadShape { .. })));
    let mut huge = schema();
    huge.tensors[0].shape = vec![u64::MAX, 2];
    assert!(matches!(huge.validate(), Err(TensorError::TooLarge { .. })));
    assert_eq!(schema().validate(), Ok(()));
}

#[test]
fn payload_round_trips_as_little_endian() {
    let s = schema();
    let values = [1.0f32, -2.0, 0.5, 0.0, 3.25, -0.125, 7.0, 8.0];
    let p = s.encode_f32(&values);
    assert_eq!(&p.data[..8], &[0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0xc0]);
    assert_eq!(s.decode_f32(&p).unwrap(), values);
}

#[test]
fn decode_names_the_problem() {
    let s = schema();
    let mut p = s.encode_f32(&[0.0; 8]);
    p.data.pop();
    assert_eq!(s.decode_f32(&p), Err(TensorError::ShapeMismatch { expected: 32, got: 31 }));
    let mut p = s.encode_f32(&[0.0; 8]);
    p.data[28..32].copy_from_slice(&f32::NAN.to_le_bytes());
    assert_eq!(s.decode_f32(&p), Err(TensorError::NonFinite { index: 7, tensor: "b".into() }));
    let mut p = s.encode_f32(&[0.0; 8]);
    p.schema_id.0[0] ^= 1;
    assert!(matches!(s.decode_f32(&p), Err(TensorError::SchemaMismatch { .. })));
}

#[test]
fn finiteness_check_agrees_with_is_finite_on_special_values() {
    let s = TensorSchema {
        tensors: vec![TensorSpec { name: "x".into(), shape: vec![1], dtype: DType::F32 }],
    };
    let specials = [
        0.0f32,
        -0.0,
        1.0,
        f32::MAX,
        f32::MIN,
        f32::MIN_POSITIVE,
        1.0e-45,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001),
        f32::from_bits(0xff7f_ffff),
    ];
    for v in specials {
        assert_eq!(
            s.check_f32_bytes(&v.to_le_bytes()).is_ok(),
            v.is_finite(),
            "{v:?} {:#x}",
            v.to_bits()
        );
    }
}

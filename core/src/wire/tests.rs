//! The CBOR codec on byte literals: tensors are byte strings, trailing garbage is refused.

use super::*;
use crate::codec::{CodecError, decode, to_vec};
use crate::tensor::{DType, TensorSpec};

#[test]
fn tensors_travel_as_one_byte_string() {
    let schema = TensorSchema {
        tensors: vec![TensorSpec { name: "w".into(), shape: vec![2], dtype: DType::F32 }],
    };
    let payload = schema.encode_f32(&[1.0, 2.0]);
    let bytes = to_vec(&payload).unwrap();
    // map(2) "schema_id" bytes(32) ... "data" bytes(8) 0000803f 00000040
    assert_eq!(bytes[0], 0xa2);
    assert!(
        bytes.ends_with(&[0x64, b'd', b'a', b't', b'a', 0x48, 0, 0, 0x80, 0x3f, 0, 0, 0, 0x40])
    );
    assert_eq!(decode::<TensorPayload>(&bytes).unwrap(), payload);
}

#[test]
fn check_in_response_encoding_is_pinned() {
    let bytes = to_vec(&CheckInResponse::ComeBackLater { retry_after_secs: 5 }).unwrap();
    expect_test::expect![
        "a16f636f6d655f6261636b5f6c61746572a17072657472795f61667465725f7365637305"
    ]
    .assert_eq(&hex::encode(&bytes));
    assert_eq!(
        decode::<CheckInResponse>(&bytes).unwrap(),
        CheckInResponse::ComeBackLater { retry_after_secs: 5 }
    );
}

#[test]
fn malformed_and_trailing_bytes_are_errors() {
    assert!(matches!(decode::<EnrollRequest>(&[0xff, 0x00]), Err(CodecError::Malformed(_))));
    assert!(matches!(decode::<EnrollRequest>(&[]), Err(CodecError::Malformed(_))));
    let mut bytes = to_vec(&EnrollRequest {
        enrollment_token: "t".into(),
        identity_key: None,
        identity_certificate: None,
    })
    .unwrap();
    bytes.push(0);
    let err = decode::<EnrollRequest>(&bytes).unwrap_err();
    assert_eq!(err.to_string(), "malformed cbor body: 1 trailing bytes after the message");
}

#[test]
fn error_code_names_match_their_wire_form() {
    use ErrorCode::*;
    for code in [
        MalformedBody,
        BodyTooLarge,
        SchemaMismatch,
        ShapeMismatch,
        NonFiniteValue,
        InvalidField,
        Unauthorized,
        NotFound,
        RoundClosed,
        NotSelected,
        DuplicateUpload,
        StaleModel,
        InvalidPlan,
        Conflict,
        Unavailable,
        Internal,
        RateLimited,
        Timeout,
        ModelNotKept,
    ] {
        assert_eq!(serde_json::to_string(&code).unwrap(), format!("\"{}\"", code.as_str()));
    }
}

/// A key of 33 bytes was once taken as its first 32: every length but 32 is refused by name,
/// as a byte string and as the array serde writes.
#[test]
fn an_identity_key_of_any_length_but_32_is_refused_by_name() {
    #[derive(Serialize)]
    struct Raw<K: Serialize> {
        enrollment_token: &'static str,
        identity_key: K,
    }
    let key = [7u8; 32];
    let ok = to_vec(&Raw { enrollment_token: "t", identity_key: key }).unwrap();
    assert_eq!(decode::<EnrollRequest>(&ok).unwrap().identity_key, Some(key));
    let as_bytes =
        to_vec(&Raw { enrollment_token: "t", identity_key: serde_bytes::Bytes::new(&key) });
    assert_eq!(decode::<EnrollRequest>(&as_bytes.unwrap()).unwrap().identity_key, Some(key));
    for len in [0usize, 31, 33, 64] {
        let long = vec![7u8; len];
        for bytes in [
            to_vec(&Raw { enrollment_token: "t", identity_key: &long }).unwrap(),
            to_vec(&Raw { enrollment_token: "t", identity_key: serde_bytes::Bytes::new(&long) })
                .unwrap(),
        ] {
            let err = decode::<EnrollRequest>(&bytes).unwrap_err().to_string();
            assert!(err.contains("identity_key") && err.contains(&format!("not {len}")), "{err}");
        }
    }
    let none = to_vec(&EnrollRequest {
        enrollment_token: "t".into(),
        identity_key: None,
        identity_certificate: None,
    });
    assert_eq!(decode::<EnrollRequest>(&none.unwrap()).unwrap().identity_key, None);
}

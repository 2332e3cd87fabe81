//! Each encoding against hand-worked bytes and values, the validation of hostile bytes, and
//! the statistical promises: int8 is unbiased, top-k with error feedback loses nothing.

use super::*;
use proptest::prelude::*;

fn round_trip(c: Compression, delta: &[f32]) -> Vec<f32> {
    let bytes = c.encode(delta, &mut SplitMix64(7), &mut ErrorFeedback::default());
    assert_eq!(bytes.len() as u64, c.max_encoded_len(delta.len()), "{c:?}");
    c.validate(delta.len(), bytes).unwrap().to_f32()
}

#[test]
fn dense_encodings_round_to_their_precision() {
    let delta = [1.0f32, -0.5, 0.1, 3.0e-5, 70000.0];
    assert_eq!(round_trip(Compression::F32, &delta), delta);
    // f16: 0.1 → 0.099975586, 3e-5 is subnormal, 70000 saturates at 65504.
    assert_eq!(
        round_trip(Compression::F16, &delta),
        [1.0, -0.5, 0.099975586, 2.9981136e-5, 65504.0]
    );
    // bf16 keeps 8 significant bits and f32's range.
    assert_eq!(
        round_trip(Compression::Bf16, &delta),
        [1.0, -0.5, 0.100_097_656, 3.0040741e-5, 70144.0]
    );
    let bytes =
        Compression::F16.encode(&[1.0, -2.0], &mut SplitMix64(0), &mut ErrorFeedback::default());
    assert_eq!(bytes, [0x00, 0x3c, 0x00, 0xc0]);
}

#[test]
fn int8_scales_each_block_by_its_largest_magnitude() {
    let c = Compression::Int8 { block: 2 };
    // Blocks [127, -63.5] and [0.5, 0]: scales 1 and 0.5/127; 127 and 0.5 are exact codes.
    let bytes =
        c.encode(&[127.0, -63.5, 0.5, 0.0], &mut SplitMix64(1), &mut ErrorFeedback::default());
    assert_eq!(&bytes[..4], &1.0f32.to_le_bytes());
    assert_eq!(bytes[8], 127);
    assert_eq!(bytes[10], 127);
    assert_eq!(bytes[11], 0);
    assert!(bytes[9] as i8 == -63 || bytes[9] as i8 == -64, "{}", bytes[9] as i8);
    let decoded = c.validate(4, bytes).unwrap().to_f32();
    assert_eq!(decoded[0], 127.0);
    assert!((decoded[2] - 0.5).abs() < 1e-6);
}

#[test]
fn int8_stochastic_rounding_is_unbiased() {
    let c = Compression::Int8 { block: 4 };
    // 0.3 of a step between codes: nearest rounding would always give 0.
    let delta = [127.0f32, 0.3, -0.3, 10.3];
    let mut rng = SplitMix64(42);
    let trials = 20_000;
    let mut sums = [0.0f64; 4];
    for _ in 0..trials {
        let bytes = c.encode(&delta, &mut rng, &mut ErrorFeedback::default());
        c.validate(4, bytes).unwrap().for_each(|i, v| sums[i] += f64::from(v));
    }
    for (sum, want) in sums.iter().zip(delta) {
        let mean = sum / f64::from(trials);
        // A Bernoulli(0.3) step of 1 has sd 0.46; 4σ over 20 000 trials is 0.013.
        assert!((mean - f64::from(want)).abs() < 0.013, "{mean} vs {want}");
    }
}

#[test]
fn top_k_sends_the_largest_and_feeds_back_the_rest() {
    let c = Compression::TopK { fraction: 0.5 };
    let mut feedback = ErrorFeedback::default();
    let mut rng = SplitMix64(0);
    let bytes = c.encode(&[0.1, -3.0, 2.0, 0.5], &mut rng, &mut feedback);
    let mut want = 2u32.to_le_bytes().to_vec();
    [1u32, 2].iter().for_each(|i| want.extend_from_slice(&i.to_le_bytes()));
    [-3.0f32, 2.0].iter().for_each(|v| want.extend_from_slice(&v.to_le_bytes()));
    assert_eq!(bytes, want);
    assert_eq!(feedback.residual, [0.1, 0.0, 0.0, 0.5]);
    // Next round the residual rides along: 0.5 + 0.6 wins over 1.0.
    let bytes = c.encode(&[0.0, 0.0, 1.0, 0.6], &mut rng, &mut feedback);
    assert_eq!(c.validate(4, bytes).unwrap().to_f32(), [0.0, 0.0, 1.0, 1.1]);
    assert_eq!(feedback.residual, [0.1, 0.0, 0.0, 0.0]);
}

#[test]
fn hostile_bytes_are_refused_by_name() {
    let n = 4;
    let err = |c: Compression, bytes: Vec<u8>| c.validate(n, bytes).unwrap_err().to_string();
    assert_eq!(err(Compression::F16, vec![0; 7]), "f16 delta has 7 bytes, 8 expected for 4 values");
    let mut inf = vec![0u8; 8];
    inf[5] = 0x7c;
    assert_eq!(err(Compression::F16, inf), "f16 delta: value 2 is not finite");
    let int8 = Compression::Int8 { block: 256 };
    let mut bytes = f32::NAN.to_le_bytes().to_vec();
    bytes.extend([0, 0, 0, 0]);
    assert_eq!(err(int8, bytes), "int8 delta: value 0 is not finite");
    let mut bytes = 1.0f32.to_le_bytes().to_vec();
    bytes.extend([0, 0x80, 0, 0]);
    assert_eq!(err(int8, bytes), "int8 delta: value 1 is -128, outside -127..=127");
    let top = Compression::TopK { fraction: 0.5 };
    let sparse = |k: u32, idx: &[u32]| {
        let mut b = k.to_le_bytes().to_vec();
        idx.iter().for_each(|i| b.extend_from_slice(&i.to_le_bytes()));
        idx.iter().for_each(|_| b.extend_from_slice(&1.0f32.to_le_bytes()));
        b
    };
    assert!(err(top, sparse(2, &[2, 1])).contains("out of order"));
    assert!(err(top, sparse(2, &[1, 1])).contains("out of order"));
    assert!(err(top, sparse(1, &[4])).contains("out of order or range"));
    assert!(err(top, sparse(3, &[0, 1, 2])).contains("bytes"), "more than k values");
    assert!(err(top, vec![1, 0]).contains("bytes"));
    assert!(top.validate(n, sparse(0, &[])).unwrap().to_f32().iter().all(|&v| v == 0.0));
    // An unchecked setting is refused rather than trusted.
    assert!(err(Compression::Int8 { block: 0 }, vec![0; 4]).contains("block"));
}

#[test]
fn settings_are_checked() {
    assert_eq!("int8".parse(), Ok(Compression::Int8 { block: 256 }));
    assert_eq!("int8:64".parse(), Ok(Compression::Int8 { block: 64 }));
    assert_eq!("top_k:0.1".parse(), Ok(Compression::TopK { fraction: 0.1 }));
    assert_eq!("bf16".parse(), Ok(Compression::Bf16));
    for bad in ["top_k", "top_k:2", "int8:0", "int4", "f16:1"] {
        assert!(bad.parse::<Compression>().is_err(), "{bad}");
    }
    assert!(Compression::Int8 { block: 0 }.check().is_err());
    assert!(Compression::TopK { fraction: 0.0 }.check().is_err());
    assert!(Compression::TopK { fraction: f64::NAN }.check().is_err());
    assert!(Compression::TopK { fraction: 1.0 }.check().is_ok());
    let parsed: Compression = serde_json::from_str(r#"{"kind": "int8"}"#).unwrap();
    assert_eq!(parsed, Compression::Int8 { block: 256 });
    assert!(serde_json::from_str::<Compression>(r#"{"kind": "int8", "bits": 4}"#).is_err());
}

/// A model is encoded for download the same way every time (one content hash, every device
/// the same bytes); int8 rounds to nearest, so no value is off by more than half a step.
#[test]
fn a_model_encodes_deterministically_and_int8_rounds_to_nearest() {
    let values: Vec<f32> = (0..1000).map(|i| ((i * 37 % 201) as f32 - 100.0) * 1e-3).collect();
    for c in [Compression::F16, Compression::Bf16, Compression::Int8 { block: 64 }] {
        assert_eq!(c.encode_model(&values), c.encode_model(&values), "{c:?}");
        c.check_model().unwrap();
    }
    let c = Compression::Int8 { block: 64 };
    let decoded = c.validate(values.len(), c.encode_model(&values)).unwrap().to_f32();
    for (block, (v, d)) in values.chunks(64).zip(decoded.chunks(64)).enumerate() {
        let step = v.iter().fold(0.0f32, |m, x| m.max(x.abs())) / 127.0;
        for (x, y) in v.iter().zip(d) {
            assert!((x - y).abs() <= step / 2.0 * 1.0001, "block {block}: {x} became {y}");
        }
    }
    assert_eq!(Compression::F32.encode_model(&values), crate::tensor::f32_to_le_bytes(&values));
}

#[test]
fn top_k_is_not_a_model_encoding_and_settings_print_as_they_parse() {
    let err = Compression::TopK { fraction: 0.1 }.check_model().unwrap_err();
    assert!(err.to_string().contains("not top_k"), "{err}");
    assert!(Compression::Int8 { block: 0 }.check_model().is_err());
    for text in ["f32", "f16", "bf16", "int8:256", "int8:7", "top_k:0.01"] {
        let parsed: Compression = text.parse().unwrap();
        assert_eq!(parsed.to_string(), text);
    }
}

proptest! {
    /// Whatever the bytes, validation either refuses them or yields a delta whose fold visits
    /// only in-range indices, in order, with finite values.
    #[test]
    fn validated_deltas_fold_safely(
        kind in 0usize..5,
        n in 0usize..40,
        bytes in proptest::collection::vec(any::<u8>(), 0..200),
    ) {
        let c = [Compression::F32, Compression::F16, Compression::Bf16,
            Compression::Int8 { block: 3 }, Compression::TopK { fraction: 0.3 }][kind];
        if let Ok(delta) = c.validate(n, bytes) {
            let mut last = None;
            delta.for_each(|i, v| {
                assert!(i < n && last.is_none_or(|l| l < i) && v.is_finite());
                last = Some(i);
            });
        }
    }

    /// Payloads of exactly the right length with arbitrary bits (so every scale and value a
    /// hostile device can send, f32::MAX among them): whatever validation accepts decodes to
    /// finite values with a finite norm, in every encoding.
    #[test]
    fn validated_payloads_decode_to_finite_values_with_a_finite_norm(
        kind in 0usize..5,
        n in 1usize..40,
        words in proptest::collection::vec(any::<u32>(), 80),
        huge in proptest::collection::vec(prop_oneof![Just(f32::MAX), Just(-f32::MAX), Just(3e36f32), Just(MAX_INT8_SCALE), Just(1.0f32)], 80),
    ) {
        let c = [Compression::F32, Compression::F16, Compression::Bf16,
            Compression::Int8 { block: 3 }, Compression::TopK { fraction: 1.0 }][kind];
        // Arbitrary bit patterns, with the largest finite magnitudes mixed in.
        let mut raw: Vec<u8> = words.iter().zip(&huge).enumerate()
            .flat_map(|(i, (w, h))| if i % 2 == 0 { w.to_le_bytes() } else { h.to_le_bytes() })
            .collect();
        let bytes = match c {
            Compression::TopK { .. } => {
                let mut b = (n as u32).to_le_bytes().to_vec();
                (0..n as u32).for_each(|i| b.extend_from_slice(&i.to_le_bytes()));
                b.extend_from_slice(&raw[..4 * n]);
                b
            }
            _ => {
                raw.resize(c.max_encoded_len(n) as usize, 0);
                raw
            }
        };
        if let Ok(delta) = c.validate(n, bytes) {
            delta.for_each(|i, v| assert!(v.is_finite(), "{c:?} value {i} decodes to {v}"));
            prop_assert!(delta.norm_squared().is_finite(), "{c:?}: norm² {}", delta.norm_squared());
        }
    }

    /// Top-k with error feedback: over any rounds, what was sent plus what is still held back
    /// equals everything the device computed.
    #[test]
    fn top_k_error_feedback_loses_nothing(
        rounds in proptest::collection::vec(proptest::collection::vec(-1e3f32..1e3, 8), 1..6),
    ) {
        let c = Compression::TopK { fraction: 0.25 };
        let mut feedback = ErrorFeedback::default();
        let mut sent = [0.0f64; 8];
        let mut computed = [0.0f64; 8];
        for delta in &rounds {
            let bytes = c.encode(delta, &mut SplitMix64(0), &mut feedback);
            c.validate(8, bytes).unwrap().for_each(|i, v| sent[i] += f64::from(v));
            delta.iter().enumerate().for_each(|(i, &d)| computed[i] += f64::from(d));
        }
        for i in 0..8 {
            let total = sent[i] + f64::from(feedback.residual[i]);
            prop_assert!((total - computed[i]).abs() <= 1e-3 * (1.0 + computed[i].abs()), "{i}: {total} vs {}", computed[i]);
        }
    }
}

/// The dense encodings are checked on their exponent bits instead of decoded value
/// by value; for every f16 and bf16 bit pattern (and f32's specials) the check refuses exactly
/// the values that decode to something non-finite, at their index.
#[test]
fn the_bit_check_refuses_exactly_the_non_finite_values() {
    for c in [Compression::F16, Compression::Bf16] {
        for bits in 0..=u16::MAX {
            let mut bytes = vec![0u8; 6];
            bytes[2..4].copy_from_slice(&bits.to_le_bytes());
            let finite = c.dense_value(&bytes[2..4]).is_finite();
            match c.validate(3, bytes) {
                Ok(_) => assert!(finite, "{c:?} {bits:#06x} accepted"),
                Err(e) => {
                    assert!(!finite, "{c:?} {bits:#06x} refused: {e}");
                    assert!(matches!(e, CompressionError::NonFinite { index: 1, .. }), "{e}");
                }
            }
        }
    }
    for v in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MAX, f32::MIN_POSITIVE, -0.0] {
        let mut bytes = vec![0u8; 8];
        bytes[4..].copy_from_slice(&v.to_le_bytes());
        assert_eq!(Compression::F32.validate(2, bytes).is_ok(), v.is_finite(), "{v}");
    }
}

/// The int8 encoding as it was first written (`f64::floor`, a byte pushed per value): the
/// reference the faster loop must match byte for byte.
fn encode_int8_reference(delta: &[f32], block: usize, mut offset: impl FnMut() -> f64) -> Vec<u8> {
    let scales: Vec<f32> =
        delta.chunks(block).map(|c| c.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0).collect();
    let mut out: Vec<u8> = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
    for (chunk, &scale) in delta.chunks(block).zip(&scales) {
        for &v in chunk {
            let q = if scale > 0.0 {
                (f64::from(v) / f64::from(scale) + offset()).floor().clamp(-127.0, 127.0)
            } else {
                0.0
            };
            out.push(q as i8 as u8);
        }
    }
    out
}

proptest! {
    /// The floor that replaced `f64::floor` (a libm call on the x86-64 baseline,
    /// most of a model's int8 encoding) agrees with it on every input once clamped to int8,
    /// the infinities, NaN and values far outside i32 included.
    #[test]
    fn the_int8_floor_agrees_with_floor_on_every_f64(bits in any::<u64>(), small in -300.0f64..300.0) {
        for x in [f64::from_bits(bits), small, small.trunc(), -small.trunc()] {
            let (fast, exact) = (floor_within_i32(x).clamp(-127.0, 127.0), x.floor().clamp(-127.0, 127.0));
            prop_assert_eq!(fast as i8, exact as i8, "{}", x);
        }
    }

    /// Int8 encodings (a device's stochastic one and a model's to nearest) are the
    /// same bytes as the first implementation's, blocks of zeros and huge values included.
    #[test]
    fn int8_encodes_as_before(
        delta in proptest::collection::vec(prop_oneof![Just(0.0f32), -1e30f32..1e30, -1e-3f32..1e-3, any::<f32>()], 1..600),
        block in 1usize..300,
        seed in any::<u64>(),
    ) {
        let nearest = encode_int8(&delta, block, || 0.5);
        prop_assert_eq!(nearest, encode_int8_reference(&delta, block, || 0.5));
        let (mut a, mut b) = (SplitMix64(seed), SplitMix64(seed));
        let stochastic = encode_int8(&delta, block, || a.unit());
        prop_assert_eq!(stochastic, encode_int8_reference(&delta, block, || b.unit()));
    }
}

/// A hostile int8 scale: 127 × f32::MAX / 2 would decode to +inf and make the round's norm and
/// every honest update's contribution NaN. Refused with the scale's index; the largest scale an
/// honest encoder can produce (from a value of f32::MAX) is accepted and decodes finite.
#[test]
fn int8_scales_that_would_overflow_when_decoded_are_refused() {
    let c = Compression::Int8 { block: 2 };
    let hostile = [1.0f32, f32::MAX / 2.0];
    let mut bytes: Vec<u8> = hostile.iter().flat_map(|s| s.to_le_bytes()).collect();
    bytes.extend_from_slice(&[127, 1, 127, 0x81]);
    let err = c.validate(4, bytes).unwrap_err();
    assert!(matches!(err, CompressionError::ScaleOverflow { index: 1, .. }), "{err}");
    assert!((MAX_INT8_SCALE * 127.0).is_finite() && (MAX_INT8_SCALE * -127.0).is_finite());
    let honest = c.encode(
        &[f32::MAX, -f32::MAX, 1.0, 0.0],
        &mut SplitMix64(3),
        &mut ErrorFeedback::default(),
    );
    let decoded = c.validate(4, honest).unwrap();
    assert!(decoded.to_f32().iter().all(|v| v.is_finite()));
    assert!(decoded.norm_squared().is_finite());
}

/// A plan's `compression` or `model_download` with a field its kind does not have, or an
/// unknown one, is refused with a message naming it: a misplaced `fraction` used to be dropped
/// and the plan silently ran uncompressed.
#[test]
fn fields_a_kind_does_not_have_are_refused() {
    let parse = |json: &str| serde_json::from_str::<Compression>(json).map_err(|e| e.to_string());
    assert_eq!(parse(r#"{"kind": "int8"}"#), Ok(Compression::Int8 { block: 256 }));
    assert_eq!(parse(r#"{"kind": "int8", "block": 64}"#), Ok(Compression::Int8 { block: 64 }));
    assert_eq!(
        parse(r#"{"kind": "top_k", "fraction": 0.5}"#),
        Ok(Compression::TopK { fraction: 0.5 })
    );
    for (json, names) in [
        (r#"{"kind": "f16", "fraction": 0.1}"#, "fraction"),
        (r#"{"kind": "f32", "block": 3}"#, "block"),
        (r#"{"kind": "top_k", "fraction": 0.1, "block": 3}"#, "block"),
        (r#"{"kind": "int8", "blok": 64}"#, "blok"),
        (r#"{"kind": "f32", "level": 9}"#, "level"),
        (r#"{"kind": "top_k"}"#, "fraction"),
        (r#"{"kind": "zstd"}"#, "zstd"),
    ] {
        let err = parse(json).unwrap_err();
        assert!(err.contains(names), "{json}: {err}");
    }
    // The wire form (CBOR) reads the same way.
    let mut cbor = Vec::new();
    ciborium::into_writer(&Compression::Int8 { block: 8 }, &mut cbor).unwrap();
    assert_eq!(
        ciborium::from_reader::<Compression, _>(&cbor[..]).unwrap(),
        Compression::Int8 { block: 8 }
    );
}

/// The norm's eight running sums add up to the sum of the decoded values' squares, whatever the
/// length's remainder by eight, in every encoding.
#[test]
fn the_norm_is_the_sum_of_the_decoded_squares() {
    for c in [
        Compression::F32,
        Compression::F16,
        Compression::Int8 { block: 4 },
        Compression::TopK { fraction: 0.5 },
    ] {
        for n in [0, 1, 7, 8, 9, 23] {
            let delta: Vec<f32> = (0..n).map(|i| (i as f32 - 5.5) * 0.37).collect();
            let bytes = c.encode(&delta, &mut SplitMix64(3), &mut ErrorFeedback::default());
            let decoded = c.validate(n, bytes).unwrap();
            let by_one: f64 = decoded.to_f32().iter().map(|&v| f64::from(v).powi(2)).sum();
            let norm = decoded.norm_squared();
            assert!((norm - by_one).abs() <= 1e-12 * by_one, "{c:?}, n = {n}: {norm} ≠ {by_one}");
        }
    }
}

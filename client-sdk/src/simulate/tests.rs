//! The simulator's pure parts: attack and slowdown parsing and arithmetic, the attacker and
//! slow-device counts.

use super::*;

#[test]
fn attacks_parse_and_poison_the_delta() {
    let scale: Attack = "scale:10".parse().unwrap();
    let flip: Attack = "sign_flip:4".parse().unwrap();
    assert_eq!(scale, Attack::Scale(10.0));
    assert_eq!(flip, Attack::SignFlip(4.0));
    assert_eq!("sign_flip".parse::<Attack>(), Ok(Attack::SignFlip(1.0)));
    let mut delta = [0.5f32, -0.25, 0.0];
    scale.apply(&mut delta);
    assert_eq!(delta, [5.0, -2.5, 0.0]);
    flip.apply(&mut delta);
    assert_eq!(delta, [-20.0, 10.0, 0.0]);
    for bad in ["scale", "scale:-1", "scale:nan", "boost:2", "sign_flip:0"] {
        let err = bad.parse::<Attack>().unwrap_err();
        assert!(err.contains("attack factor") || err.contains("expected"), "{bad}: {err}");
    }
}

#[test]
fn the_attacking_share_rounds_to_whole_devices() {
    let p = |fraction| Poisoning { fraction, attack: Attack::Scale(10.0) };
    assert_eq!(p(0.1).attackers(100), 10);
    assert_eq!(p(0.1).attackers(24), 2);
    assert_eq!(p(0.0).attackers(100), 0);
    assert_eq!(p(1.0).attackers(7), 7);
}

#[test]
fn slowdowns_parse_and_pick_whole_devices() {
    let slow: Slowdown = "0.2:5".parse().unwrap();
    assert_eq!(slow, Slowdown { fraction: 0.2, factor: 5.0 });
    assert_eq!(slow.slow_devices(100), 20);
    assert_eq!(slow.slow_devices(3), 1);
    for bad in ["0.2", "1.5:2", "0.2:0.5", "x:2", "0.2:nan"] {
        let err = bad.parse::<Slowdown>().unwrap_err();
        assert!(
            err.contains("FRACTION:FACTOR")
                || err.contains("must be")
                || err.contains("fraction")
                || err.contains("factor"),
            "{bad}: {err}"
        );
    }
}

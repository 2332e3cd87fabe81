//! The simulator's pure parts: attack parsing and arithmetic, the attacker count.

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

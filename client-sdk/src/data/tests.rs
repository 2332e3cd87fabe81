//! Loaders read the real shared datasets; partitioners keep every example exactly once.

use std::path::PathBuf;

use super::*;

pub(crate) fn shared_data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/data")
}

#[test]
fn digits_load_with_their_published_label_counts() {
    let d = digits(&shared_data().join("sklearn_digits")).unwrap();
    assert_eq!(d.len(), 1797);
    let mut counts = [0; 10];
    for &l in d.labels() {
        counts[l as usize] += 1;
    }
    assert_eq!(counts, [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]);
}

#[test]
fn mnist_test_split_loads() {
    let m = mnist(&shared_data().join("mnist"), Split::Test).unwrap();
    assert_eq!(
        (m.len(), m.input()),
        (10_000, InputSpec::Image { channels: 1, height: 28, width: 28 })
    );
}

#[test]
fn corrupt_files_are_errors_not_panics() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("x");
    std::fs::write(&p, [0, 0, 8, 3, 0, 0]).unwrap();
    assert!(matches!(read_idx(&p), Err(DataError::Format { .. })));
    std::fs::write(&p, b"hello").unwrap();
    assert!(matches!(read_idx(&p), Err(DataError::Format { .. })));
    assert!(matches!(read_idx(&dir.path().join("missing")), Err(DataError::Io { .. })));
}

fn assert_partition(parts: &[Vec<usize>], n: usize) {
    let mut all: Vec<usize> = parts.iter().flatten().copied().collect();
    all.sort_unstable();
    assert_eq!(all, (0..n).collect::<Vec<_>>(), "every example exactly once");
}

#[test]
fn partitioners_cover_every_example_once_and_skew_as_asked() {
    let labels: Vec<u32> = (0..1000).map(|i| (i % 10) as u32).collect();
    let parts = iid(1000, 7, 1);
    assert_partition(&parts, 1000);
    assert!(parts.iter().all(|p| p.len() == 142 || p.len() == 143));

    let parts = dirichlet(&labels, 10, 0.1, 2);
    assert_partition(&parts, 1000);
    let classes_per_client: Vec<usize> = parts
        .iter()
        .map(|p| p.iter().map(|&i| labels[i]).collect::<std::collections::BTreeSet<_>>().len())
        .collect();
    let mean = classes_per_client.iter().sum::<usize>() as f64 / 10.0;
    assert!(mean < 6.0, "α = 0.1 should concentrate classes, got {classes_per_client:?}");

    let parts = shards(&labels, 10, 2, 3);
    assert_eq!(parts.len(), 10);
    assert_partition(&parts, 1000);
    for p in &parts {
        let classes: std::collections::BTreeSet<_> = p.iter().map(|&i| labels[i]).collect();
        assert!(classes.len() <= 2, "two shards give at most two classes, got {classes:?}");
    }
}

#[test]
fn shakespeare_roles_are_the_published_natural_clients() {
    let roles = shakespeare_roles(&shared_data().join("shakespeare_roles")).unwrap();
    assert_eq!(roles.len(), 1423);
    let theseus = &roles[0];
    assert_eq!(theseus.id, "a-midsummer-night-s-dream/THESEUS");
    // The README's leaf_samples for THESEUS: windows of 80 after LEAF's normalisation.
    let examples = next_char_examples(&theseus.text, 80, 0);
    assert_eq!(examples.len(), 9360);
    assert_eq!(examples.input(), InputSpec::Tokens { vocab: 80, length: 80 });
    let hamlet = roles.iter().find(|r| r.id == "hamlet/HAMLET").unwrap();
    assert!(hamlet.text.contains("To be, or not to be"));
    assert_eq!(next_char_examples(&hamlet.text, 80, 100).len(), 100);
    assert!(!hamlet.text.contains("  ") && !hamlet.text.contains('\n'));
}

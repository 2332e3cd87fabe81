//! Differential privacy: the accountant against Google's `dp-accounting`, and DP-FedAvg runs
//! that report the ε they spent and stop at their budget.

use std::process::Command;

use starling_core::privacy::RdpAccountant;
use starling_tests::python_with;

/// The grid: sampling rate, noise multiplier, steps, δ.
const GRID: &[(f64, f64, u64, f64)] = &[
    (0.001, 0.5, 1, 1e-5),
    (0.01, 1.0, 100, 1e-5),
    (0.01, 1.1, 6000, 1e-5),
    (0.02, 0.8, 1000, 1e-6),
    (0.05, 2.0, 50, 1e-5),
    (0.1, 1.0, 200, 1e-5),
    (0.1, 4.0, 1000, 1e-8),
    (0.25, 1.5, 30, 1e-5),
    (0.5, 3.0, 10, 1e-3),
    (1.0, 1.0, 1, 1e-5),
    (1.0, 10.0, 500, 1e-5),
    (0.004, 0.7, 10_000, 1e-5),
];

/// Google's reference: the RDP accountant of `dp-accounting`, over its default orders (the same
/// as ours), composing a Poisson-sampled Gaussian event.
const REFERENCE: &str = r#"
import json, sys
import dp_accounting
grid = json.loads(sys.argv[1])
out = []
for q, z, steps, delta in grid:
    acc = dp_accounting.rdp.RdpAccountant()
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    acc.compose(event, int(steps))
    out.append(acc.get_epsilon(delta))
print(json.dumps(out))
"#;

#[test]
fn r17_the_accountant_agrees_with_google_dp_accounting() {
    let Some(python) = python_with(&["dp_accounting"]) else { return };
    let grid: Vec<(f64, f64, u64, f64)> = GRID.to_vec();
    let output = Command::new(python)
        .args(["-c", REFERENCE, &serde_json::to_string(&grid).unwrap()])
        .output()
        .expect("running Python");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let reference: Vec<f64> = serde_json::from_slice(&output.stdout).expect("a list of ε");
    let mut worst = 0.0f64;
    for (&(q, z, steps, delta), want) in GRID.iter().zip(reference) {
        let got = RdpAccountant::new(q, z).epsilon(steps, delta);
        let rel = (got - want).abs() / want.abs().max(1e-12);
        eprintln!(
            "q={q} z={z} steps={steps} δ={delta}: ours {got:.6}, dp-accounting {want:.6}, rel {rel:.2e}"
        );
        assert!(
            rel <= 0.01,
            "q={q} z={z} steps={steps} δ={delta}: ε {got} vs dp-accounting {want}"
        );
        worst = worst.max(rel);
    }
    eprintln!("worst relative difference {worst:.2e}");
}

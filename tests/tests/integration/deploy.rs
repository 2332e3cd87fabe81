//! The Kubernetes manifests (`coordinator/deploy/kubernetes`, `aggregator/deploy/kubernetes`):
//! valid against the Kubernetes API schemas (`kubernetes-validate --strict`, from PyPI), and
//! consistent with the binaries they run: every `STARLING_*` variable is one the binary reads,
//! and the probes are the routes that implement the HA behaviour.

use std::path::{Path, PathBuf};
use std::process::Command;

use starling_core::wire::path;
use starling_tests::python_with;

fn manifests() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    vec![
        root.join("coordinator/deploy/kubernetes/secrets.yaml"),
        root.join("coordinator/deploy/kubernetes/coordinator.yaml"),
        root.join("aggregator/deploy/kubernetes/aggregator.yaml"),
    ]
}

fn validate(python: &Path, files: &[PathBuf]) -> std::process::Output {
    Command::new(python)
        .args(["-m", "kubernetes_validate", "--strict", "--quiet"])
        .args(files)
        .output()
        .expect("running kubernetes-validate")
}

/// Every document of `files` as JSON (PyYAML, which kubernetes-validate brings).
fn documents(python: &Path, files: &[PathBuf]) -> Vec<serde_json::Value> {
    let script = "import json, sys, yaml\n\
        print(json.dumps([d for f in sys.argv[1:] for d in yaml.safe_load_all(open(f)) if d]))";
    let out = Command::new(python).args(["-c", script]).args(files).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The `[env: NAME=]` variables a binary's `--help` names.
fn env_vars(bin: &str, args: &[&str]) -> Vec<String> {
    let out = Command::new(bin).args(args).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout).into_owned();
    help.split("[env: ")
        .skip(1)
        .map(|rest| rest.split(['=', ']']).next().unwrap().to_owned())
        .collect()
}

#[test]
fn kubernetes_manifests_validate_and_match_the_binaries() {
    let Some(python) = python_with(&["kubernetes_validate", "yaml"]) else { return };
    let files = manifests();
    let out = validate(&python, &files);
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The validator does catch a broken manifest (a port that is not a number).
    let dir = tempfile::tempdir().unwrap();
    let broken = dir.path().join("broken.yaml");
    let text = std::fs::read_to_string(&files[1]).unwrap();
    std::fs::write(&broken, text.replace("containerPort: 8080", "containerPort: eighty")).unwrap();
    assert!(!validate(&python, &[broken]).status.success(), "a broken manifest passed");

    let coordinator_env = env_vars(env!("CARGO_BIN_EXE_coordinator_under_test"), &["serve"]);
    let aggregator_env = env_vars(env!("CARGO_BIN_EXE_aggregator_under_test"), &[]);
    assert!(coordinator_env.iter().any(|v| v == "STARLING_DATABASE_URL"), "{coordinator_env:?}");
    let mut containers = 0;
    for doc in documents(&python, &files) {
        let Some(spec) = doc.pointer("/spec/template/spec/containers/0") else { continue };
        containers += 1;
        let (known, liveness, readiness) = match spec["name"].as_str().unwrap() {
            "coordinator" => (&coordinator_env, path::LIVEZ, Some(path::LEADERZ)),
            "aggregator" => (&aggregator_env, path::LIVEZ, None),
            other => panic!("a container {other} that no binary runs"),
        };
        for var in spec["env"].as_array().unwrap() {
            let name = var["name"].as_str().unwrap();
            if name.starts_with("STARLING_") {
                assert!(known.iter().any(|k| k == name), "{name} is not read by the binary");
            }
        }
        assert_eq!(spec["livenessProbe"]["httpGet"]["path"], liveness);
        assert_eq!(spec["readinessProbe"]["httpGet"]["path"].as_str(), readiness);
        // TLS is on in both; the probes speak it.
        assert_eq!(spec["livenessProbe"]["httpGet"]["scheme"], "HTTPS");
    }
    assert_eq!(containers, 2);
}

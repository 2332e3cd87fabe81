//! The `starling-coordinator` binary as an operator uses it: `migrate`, `serve` from a config
//! file, and clear refusals of a bad configuration.

use std::path::Path;
use std::process::Command;

use starling_tests::{ChildCoordinator, OPERATOR_TOKEN, free_addr};

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_coordinator_under_test"))
}

#[test]
fn migrate_creates_the_embedded_store() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("nested").join("s.db");
    std::fs::create_dir_all(db.parent().unwrap()).unwrap();
    let out = Command::new(bin())
        .args(["migrate", "--database-url", &format!("sqlite://{}", db.display())])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(db.exists());
}

#[test]
fn serve_refuses_a_missing_or_short_operator_token_and_unknown_config_keys() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("s.db").display());
    let out = Command::new(bin())
        .args(["serve", "--insecure-http", "--database-url", &db])
        .env_remove("STARLING_OPERATOR_TOKEN")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("an operator token is required"));
    let out = Command::new(bin())
        .args(["serve", "--insecure-http", "--database-url", &db, "--operator-token", "short"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("at least 16 characters"));
    // TLS is on by default: without a certificate, plain HTTP must be asked for.
    let out = Command::new(bin())
        .args(["serve", "--database-url", &db, "--operator-token", "0123456789abcdefgh"])
        .env_remove("STARLING_TLS_CERT")
        .env_remove("STARLING_INSECURE_HTTP")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("TLS is on by default"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let config = dir.path().join("bad.toml");
    std::fs::write(&config, "listn = \"127.0.0.1:1\"\n").unwrap();
    let out =
        Command::new(bin()).args(["serve", "--config", config.to_str().unwrap()]).output().unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("unknown field"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn serve_reads_its_config_file_and_flags_win() {
    let dir = tempfile::tempdir().unwrap();
    let listen = free_addr();
    let config = dir.path().join("starling.toml");
    let db = dir.path().join("from-file.db");
    std::fs::write(
        &config,
        format!("listen = \"{listen}\"\ndatabase_url = \"sqlite://{}\"\noperator_token = \"{OPERATOR_TOKEN}\"\n", db.display()),
    )
    .unwrap();
    // ChildCoordinator passes STARLING_DATABASE_URL and --listen; STARLING_CONFIG supplies the rest.
    let log = dir.path().join("log");
    let flag_db = dir.path().join("from-env.db");
    let child = ChildCoordinator::spawn_with(
        bin(),
        &format!("sqlite://{}", flag_db.display()),
        listen,
        &log,
        &[("STARLING_CONFIG", config.to_str().unwrap())],
    )
    .await
    .unwrap();
    let admin = starling_client::protocol::AdminClient::new(&child.url, OPERATOR_TOKEN);
    assert!(admin.enrollment_token(1).await.is_ok());
    assert!(flag_db.exists(), "the environment's database URL must win over the file's");
    assert!(!db.exists());
}

/// `starling-client participate`, as a Linux/IoT device runs it: two devices, one with an IDX
/// directory and one with a CSV file, enroll, train for three rounds and save their credential;
/// bad input is refused with the line named, and an unenrolled device without a token is told
/// what to pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn linux_devices_train_from_local_files() {
    use starling_client::data;

    let client = Path::new(env!("CARGO_BIN_EXE_client_under_test"));
    let (dir, db) = starling_tests::sqlite_db();
    let c = starling_tests::start_in_process(&db).await.unwrap();
    let digits_dir = starling_tests::shared_data().join("sklearn_digits");
    let digits = data::digits(&digits_dir).unwrap();
    let plan = starling_tests::mlp_plan(digits.input(), 2, 3);
    let run = starling_core::RunId(c.admin.create_run(&plan).await.unwrap().id);
    let token = c.admin.enrollment_token(2).await.unwrap();

    // Device A: the IDX files under the names the CLI looks for.
    let idx = dir.path().join("device-a");
    std::fs::create_dir_all(&idx).unwrap();
    for (from, to) in [
        ("digits-images-idx3-ubyte", "images-idx3-ubyte"),
        ("digits-labels-idx1-ubyte", "labels-idx1-ubyte"),
    ] {
        std::fs::copy(digits_dir.join(from), idx.join(to)).unwrap();
    }
    // Device B: a CSV of the first 400 digits.
    let csv = dir.path().join("device-b.csv");
    let width = 64;
    let all: Vec<usize> = (0..400).collect();
    let mut text = String::new();
    let subset = digits.subset(&all);
    for (i, label) in subset.labels().iter().enumerate() {
        let row: Vec<String> =
            subset.features()[i * width..(i + 1) * width].iter().map(|v| v.to_string()).collect();
        text += &format!("{label},{}\n", row.join(","));
    }
    std::fs::write(&csv, &text).unwrap();

    let participate = |state: &Path, examples: &Path, extra: &[&str]| {
        let mut cmd = tokio::process::Command::new(client);
        cmd.args(["participate", "--url", &c.url, "--backend", "cpu", "--uploads", "3"])
            .args(["--max-wait-secs", "1"])
            .arg("--state")
            .arg(state)
            .arg("--examples")
            .arg(examples)
            .args(extra);
        cmd
    };
    let state_a = dir.path().join("a.json");
    let state_b = dir.path().join("b.json");
    let a = participate(&state_a, &idx, &["--pixel-scale", "0.0625"])
        .env("STARLING_ENROLLMENT_TOKEN", &token)
        .output();
    let b = participate(&state_b, &csv, &["--input", "image:1:8:8", "--enrollment-token", &token])
        .output();
    let (a, b) = tokio::join!(a, b);
    for out in [a.unwrap(), b.unwrap()] {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(stdout.matches(": uploaded, training loss").count(), 3, "{stdout}");
    }
    // The last commit may still be finishing the run when the devices exit.
    starling_tests::wait_model(&c.admin, run, 3).await.unwrap();
    let view = c.admin.run(run).await.unwrap();
    assert_eq!(view.rounds_committed, 3);
    for r in c.admin.rounds(run).await.unwrap() {
        assert_eq!(r.n_reported.unwrap(), 2);
    }
    let saved: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&state_a).unwrap()).unwrap();
    assert!(saved["credential"].as_str().is_some_and(|c| !c.is_empty()));

    // Bad input is named, and nothing was enrolled for it.
    std::fs::write(&csv, format!("{text}3,0.5,oops\n")).unwrap();
    let bad = participate(&dir.path().join("c.json"), &csv, &["--input", "image:1:8:8"])
        .output()
        .await
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("line 401"), "{bad:?}");
    let unenrolled = participate(&dir.path().join("d.json"), &idx, &[]).output().await.unwrap();
    assert!(!unenrolled.status.success());
    assert!(String::from_utf8_lossy(&unenrolled.stderr).contains("--enrollment-token"));
    assert!(!dir.path().join("d.json").exists());
    c.running.shutdown().await.unwrap();
}

/// A simulation that cannot progress once failed round after round for 19 minutes with nothing
/// printed. Now each failed round is printed with why as it fails, `--timeout` bounds the whole
/// simulation, and the simulator stops its run and exits non-zero with a one-line summary, not
/// a backtrace. Here two clients cannot make a cohort of three: every round fails selection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_simulation_that_cannot_progress_says_each_failure_and_exits_with_a_summary() {
    let client = Path::new(env!("CARGO_BIN_EXE_client_under_test"));
    let (_dir, db) = starling_tests::sqlite_db();
    let c = starling_tests::start_in_process(&db).await.unwrap();
    let started = std::time::Instant::now();
    let out = tokio::process::Command::new(client)
        .args(["simulate", "--url", &c.url, "--operator-token", OPERATOR_TOKEN])
        .arg("--data-dir")
        .arg(starling_tests::shared_data())
        .args(["--clients", "2", "--cohort", "3", "--min-quorum", "3", "--rounds", "3"])
        .args(["--over-selection", "1.0", "--selection-timeout-secs", "0.3"])
        .args(["--reporting-timeout-secs", "1", "--backend", "cpu", "--timeout", "3"])
        .env("RUST_BACKTRACE", "1")
        .output()
        .await
        .unwrap();
    let (stdout, stderr) =
        (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    assert!(started.elapsed() < std::time::Duration::from_secs(60), "the timeout held");
    assert!(stdout.contains("round 0 failed: too_few_selected"), "{stdout}");
    let error: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(error.len(), 1, "{stderr}");
    assert!(
        error[0].contains("did not finish within 3 s")
            && error[0].contains("0 of 3 rounds committed"),
        "{stderr}"
    );
    assert!(!stderr.contains("stack backtrace") && !stderr.contains("panicked"), "{stderr}");
    // Its run was stopped, not left failing rounds.
    let runs = c.admin.runs().await.unwrap();
    assert_eq!(runs.len(), 1);
    assert_eq!(runs[0].status, "stopped");
    c.running.shutdown().await.unwrap();
}

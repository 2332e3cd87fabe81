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
        .args(["serve", "--database-url", &db])
        .env_remove("STARLING_OPERATOR_TOKEN")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("an operator token is required"));
    let out = Command::new(bin())
        .args(["serve", "--database-url", &db, "--operator-token", "short"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("at least 16 characters"));
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
    assert!(admin.enrollment_token(Some(1)).await.is_ok());
    assert!(flag_db.exists(), "the environment's database URL must win over the file's");
    assert!(!db.exists());
}

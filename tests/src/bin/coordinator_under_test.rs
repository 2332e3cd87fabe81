//! The coordinator's own entry point, built inside this package so that end-to-end tests can
//! spawn (and SIGKILL) it as a child process through `CARGO_BIN_EXE_coordinator_under_test`.

#[path = "../../../coordinator/src/bin/starling-coordinator/main.rs"]
mod coordinator;

fn main() -> anyhow::Result<()> {
    coordinator::main()
}

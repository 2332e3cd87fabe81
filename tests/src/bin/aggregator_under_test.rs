//! The aggregator's own entry point, built inside this package so that end-to-end tests can
//! spawn (and SIGKILL) it as a child process through `CARGO_BIN_EXE_aggregator_under_test`.

#[path = "../../../aggregator/src/bin/starling-aggregator/main.rs"]
mod aggregator;

fn main() -> anyhow::Result<()> {
    aggregator::main()
}

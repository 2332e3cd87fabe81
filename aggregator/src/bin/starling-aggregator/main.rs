//! `starling-aggregator`: the aggregator's command line. The end-to-end tests build this same file
//! (and its `cli` module) into their own `aggregator_under_test` binary, to spawn and SIGKILL it.

mod cli;

/// Runs the command line.
pub fn main() -> anyhow::Result<()> {
    cli::main()
}

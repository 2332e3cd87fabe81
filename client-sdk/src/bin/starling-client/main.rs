//! `starling-client`: the SDK's command line for devices and simulations (`participate`,
//! `simulate`, `evaluate`). The end-to-end tests build this same file (and its `cli` module)
//! into their own `client_under_test` binary.

mod cli;

/// Runs the command line.
pub fn main() -> anyhow::Result<()> {
    cli::main()
}

//! `starling`: the operator's command line over the admin API. The end-to-end tests build this
//! same file (and its `operator` module) into their own `operator_under_test` binary.

mod operator;

/// Runs the command line.
pub fn main() -> anyhow::Result<()> {
    operator::main()
}

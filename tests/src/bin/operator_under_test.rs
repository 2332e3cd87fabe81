//! The operator's command line (`starling`), built inside this package so that tests can run it
//! as a child process through `CARGO_BIN_EXE_operator_under_test`.

#[path = "../../../client-sdk/src/bin/starling/main.rs"]
mod real;

fn main() -> anyhow::Result<()> {
    real::main()
}

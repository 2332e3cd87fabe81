//! The operator's command line (`starling`), built inside this package so that tests can run it
//! as a child process through `CARGO_BIN_EXE_operator_under_test`.

fn main() -> anyhow::Result<()> {
    starling_client::operator::main()
}

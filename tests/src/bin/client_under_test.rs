//! The SDK's command line, built inside this package so that tests can run it as a child
//! process through `CARGO_BIN_EXE_client_under_test`.

fn main() -> anyhow::Result<()> {
    starling_client::cli::main()
}

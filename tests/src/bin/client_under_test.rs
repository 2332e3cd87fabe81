//! The SDK's command line, built inside this package so that tests can run it as a child
//! process through `CARGO_BIN_EXE_client_under_test`.

#[path = "../../../client-sdk/src/bin/starling-client/main.rs"]
mod real;

fn main() -> std::process::ExitCode {
    real::main()
}

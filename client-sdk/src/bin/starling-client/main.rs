//! `starling-client`: the SDK's command line for devices and simulations (`participate`,
//! `simulate`, `evaluate`). The end-to-end tests build this same file (and its `cli` module)
//! into their own `client_under_test` binary.

mod cli;

/// Training frees and allocates megabytes of activations every step; glibc's malloc hands them
/// back to the kernel and faults them in again, mimalloc keeps them (docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Runs the command line. A failure is one line on standard error (its causes joined), and the
/// exit status 1: a stopped simulation says why, not a backtrace.
pub fn main() -> std::process::ExitCode {
    match cli::main() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

//! `starling`: the operator's command line over the admin API. The end-to-end tests build this
//! same file (and its `operator` module) into their own `operator_under_test` binary.

mod operator;

/// Training frees and allocates megabytes of activations every step; glibc's malloc hands them
/// back to the kernel and faults them in again, mimalloc keeps them (docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Runs the command line.
pub fn main() -> anyhow::Result<()> {
    match operator::main() {
        // Its reader went away (`starling runs list | head -1`): done, quietly.
        Err(e) if operator::is_broken_pipe(&e) => Ok(()),
        other => other,
    }
}

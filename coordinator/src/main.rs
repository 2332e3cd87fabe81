//! `starling-coordinator`: the coordinator binary; all of it is in the library's `cli` module.

fn main() -> anyhow::Result<()> {
    starling_coordinator::cli::main()
}

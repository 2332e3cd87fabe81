//! The `starling-aggregator` binary: one aggregator node of the datacenter tier.

fn main() -> anyhow::Result<()> {
    starling_aggregator::cli::main()
}

//! `starling-client`: the SDK's command line (see [`starling_client::cli`]).

fn main() -> anyhow::Result<()> {
    starling_client::cli::main()
}

//! `starling`: the operator's command line (see [`starling_client::operator`]).

fn main() -> anyhow::Result<()> {
    starling_client::operator::main()
}

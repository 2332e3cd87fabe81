#!/usr/bin/env bash
# The switch from Flower, measured on this machine in one sitting: the same PyTorch CNN on the
# same MNIST partition, federated by Flower 1.x (simulation engine and deployment engine) and by
# Starling's Python SDK against the release coordinator on Postgres, at N = 10 and N = 100
# clients (`CLIENTS`, `ROUNDS` override). Prints one row per run and keeps the JSON in $OUT.
#
#   client-sdk/python/benches/vs_flower/vs_flower.sh
#
# Flower lives in this benchmark's own venv (STARLING_FLOWER_VENV, default
# /var/tmp/starling-bench/flower-venv), never in the product's dependencies; PyTorch comes from
# the test suite's venv (STARLING_TORCH_VENV) through a .pth file, and Starling's wheel is built
# here and installed into the same venv. DATABASE_URL names a Postgres the script may create a
# database on (`cargo xtask postgres` prints one).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../../.." && pwd)
target=${CARGO_TARGET_DIR:-/var/tmp/starling-target}
torch_venv=${STARLING_TORCH_VENV:-/var/tmp/starling-torch/venv}
venv=${STARLING_FLOWER_VENV:-/var/tmp/starling-bench/flower-venv}
flower_version=1.42.0
clients=${CLIENTS:-"10 100"}
rounds=${ROUNDS:-10}
# Flower's deployment engine runs a SuperNode process and a ClientApp process (PyTorch
# imported) per client: at 100 clients on this 2-core machine its SuperLink is starved and
# SuperNodes that timed out registering are refused on retry, so the first round never
# trains (docs/benchmarks.md); DEPLOY_MAX_CLIENTS=100 tries it.
deploy_max=${DEPLOY_MAX_CLIENTS:-10}
out=${OUT:-$target/vs-flower}
database_url=${DATABASE_URL:?set DATABASE_URL (cargo xtask postgres prints one)}
mkdir -p "$out"

if ! "$torch_venv/bin/python" -c "import torch" 2>/dev/null; then
    python3 -m venv "$torch_venv"
    "$torch_venv/bin/pip" install --quiet -r "$root/client-sdk/python/tests/requirements.txt"
fi
if ! "$venv/bin/python" -c "import flwr" 2>/dev/null || [ ! -x "$venv/bin/maturin" ]; then
    python3 -m venv --clear "$venv"
    site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    "$torch_venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$site/starling-torch.pth"
    "$venv/bin/pip" install --quiet "flwr[simulation]==$flower_version" maturin==1.9.6
fi

cd "$root"
CARGO_TARGET_DIR=$target cargo build --quiet --release -p starling-coordinator
rm -rf "$out/wheels"
# The wheel as the test suite builds it (dev profile, dependencies optimized): the devices' time
# is PyTorch's, and a release build of the SDK's dependencies (burn) would add minutes.
CARGO_TARGET_DIR=$target CARGO_INCREMENTAL=0 "$venv/bin/maturin" build --quiet --profile dev \
    -m client-sdk/python/Cargo.toml -o "$out/wheels" -i "$venv/bin/python"
"$venv/bin/pip" install --quiet --force-reinstall --no-deps "$out"/wheels/*.whl
export STARLING_COORDINATOR_BIN=$target/release/starling-coordinator

base=${database_url%/*}
for n in $clients; do
    for side in starling starling-2p flower-sim flower-deploy; do
        if [ "$side" = flower-deploy ] && [ "$n" -gt "$deploy_max" ]; then
            echo "== $side, $n clients: not run (over DEPLOY_MAX_CLIENTS=$deploy_max)" >&2
            continue
        fi
        db=starling_vs_flower_$$_$n
        extra=()
        run_side=$side
        if [ "$side" = starling-2p ]; then
            # Devices in two processes, as Flower's simulation runs two Ray actors on 2 cores.
            run_side=starling
            extra=(--processes 2)
        fi
        if [ "$run_side" = starling ]; then
            psql -q "$database_url" -c "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db"
            extra+=(--database-url "$base/$db")
        fi
        echo "== $side, $n clients, $rounds rounds" >&2
        if ! "$venv/bin/python" "$here/bench.py" --side "$run_side" --clients "$n" --rounds "$rounds" \
            --out "$out/$side-$n.json" "${extra[@]}" > "$out/$side-$n.log" 2>&1; then
            echo "   $side at $n clients failed: $(tail -n 3 "$out/$side-$n.log")" >&2
        fi
        if [ "$run_side" = starling ]; then psql -q "$database_url" -c "DROP DATABASE IF EXISTS $db"; fi
    done
done
"$venv/bin/python" "$here/table.py" "$out"/*.json

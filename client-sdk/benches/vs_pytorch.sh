#!/usr/bin/env bash
# Starling's CPU training beside PyTorch's, on this machine, in one sitting: the anchor that the
# `train_throughput` figures in docs/benchmarks.md are held to.
#
# PyTorch is installed from PyPI into a venv of its own (once; about 5 GiB, because PyPI's Linux
# wheel brings CUDA's libraries even for the CPU), in `STARLING_BENCH_VENV` or else
# /var/tmp/starling-bench/torch-venv: outside the build directory, whose size `cargo xtask test`
# keeps under a budget. The project's runtime never needs it. The two benchmarks then run interleaved, Starling first, `ROUNDS`
# times (default 2), with PyTorch on as many threads as the machine has cores, and the table
# gives every pass and the ratio of the best rates.
#
#   client-sdk/benches/vs_pytorch.sh
#
# The Starling side is built as the test suite builds it (the dev profile, with dependencies
# optimized and without their debug assertions), so a warm test build is reused.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
venv=${STARLING_BENCH_VENV:-/var/tmp/starling-bench/torch-venv}
torch_version=2.15.0
rounds=${ROUNDS:-2}
threads=$(nproc)

if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    echo "installing torch $torch_version into $venv" >&2
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --progress-bar off "torch==$torch_version"
fi

cd "$root"
bench=$(cargo bench --workspace --features starling-mobile/bindgen --profile dev \
    --bench train_throughput --no-run --message-format json 2>/dev/null |
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "train_throughput" and m.get("executable"):
        print(m["executable"])')

log=$(mktemp)
trap 'rm -f "$log"' EXIT
for pass in $(seq "$rounds"); do
    echo "pass $pass: starling" >&2
    (cd client-sdk && STARLING_BENCH_BACKENDS=cpu "$bench" --bench) | sed "s/^/starling $pass /" >>"$log"
    echo "pass $pass: pytorch" >&2
    "$venv/bin/python" client-sdk/benches/pytorch_anchor.py "$root/../shared/data/mnist" "$threads" |
        sed "s/^/pytorch $pass /" >>"$log"
done

python3 - "$log" "$threads" <<'EOF'
import collections, platform, re, sys
rates = collections.defaultdict(list)
notes = []
for line in open(sys.argv[1]):
    who, _, rest = line.split(" ", 2)
    m = re.match(r"(cpu|torch)\s+(mlp|cnn)\s+(\d+)\s+\d+\s+(\d+)\s*$", rest)
    if m:
        rates[(m[2], int(m[3]), who)].append(int(m[4]))
    elif "GFLOP/s" in rest and ("1024³" in rest or "2048³" in rest):
        notes.append(f"{who}: {rest.strip()}")
cpu = open("/proc/cpuinfo").read()
model = re.search(r"model name\s*:\s*(.*)", cpu)
print(f"{model[1] if model else platform.processor()}, {sys.argv[2]} threads")
print("| model | batch | Starling ex/s | PyTorch ex/s | PyTorch ÷ Starling (best) |")
print("|---|---|---|---|---|")
for name, batch in [("mlp", 10), ("mlp", 64), ("cnn", 10), ("cnn", 64)]:
    ours, theirs = rates[(name, batch, "starling")], rates[(name, batch, "pytorch")]
    if not ours or not theirs:
        sys.exit(f"missing rows for {name} B={batch}")
    label = {"mlp": "MNIST 2NN", "cnn": "FedAvg CNN"}[name]
    print(f"| {label} | {batch} | {', '.join(map(str, ours))} | {', '.join(map(str, theirs))} | {max(theirs) / max(ours):.2f}× |")
for note in notes:
    print(note)
EOF

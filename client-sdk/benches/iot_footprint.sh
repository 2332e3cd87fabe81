#!/usr/bin/env bash
# The device's footprint, as a benchmark (figures for docs/benchmarks.md): the size of the
# stripped CPU-only device binary and of the mobile shared library, what dominates the binary,
# and the peak memory and wall time of `starling-client participate` training the MNIST 2NN and
# the FedAvg paper's CNN for one round (600 examples, B = 10, E = 1), first unconfined and then
# in a cgroup of 256 MiB (no swap) and one core, which this script creates and removes. A run
# that the cgroup's OOM killer ends fails the benchmark.
#
#   client-sdk/benches/iot_footprint.sh            (root, for the cgroup; from the repository)
#
# Needs the workspace's dev build for the coordinator (`cargo xtask test` or `demo` makes it),
# python3, curl, GNU time, and cgroup v2 with the memory and cpu controllers or cgroup v1's
# memory and cpu hierarchies. STARLING_DATA_DIR points at the shared datasets.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
target="${CARGO_TARGET_DIR:-$root/target}"
data="${STARLING_DATA_DIR:-$root/../shared/data}"
work="$(mktemp -d)"
cgroup_dirs=()
coordinator_pid=""
cleanup() {
  [ -n "$coordinator_pid" ] && kill "$coordinator_pid" 2>/dev/null || true
  for dir in "${cgroup_dirs[@]}"; do rmdir "$dir" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

echo "== builds (profile device: fat LTO, one codegen unit, panic=abort, stripped)"
cargo build -q --profile device -p starling-client --no-default-features --features tools --bin starling-client
# The library keeps unwinding: UniFFI turns a panic into an exception, not an abort of the app.
CARGO_PROFILE_DEVICE_PANIC=unwind cargo build -q --profile device -p starling-mobile --lib
cargo build -q --workspace --features starling-mobile/bindgen --bins
device_bin="$target/device/starling-client"
mobile_lib="$target/device/libstarling_mobile.so"
size_mib() { awk -v b="$(stat -c %s "$1")" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "device binary (CPU only, no wgpu): $(size_mib "$device_bin")"
echo "mobile shared library (wgpu + CPU, unwinding): $(size_mib "$mobile_lib")"

echo "== 600 MNIST training examples, one client's share in the FedAvg paper"
mkdir -p "$work/examples"
python3 - "$data/mnist" "$work/examples" <<'PY'
import gzip, struct, sys
src, dst = sys.argv[1], sys.argv[2]
n = 600
with gzip.open(f"{src}/train-images-idx3-ubyte.gz") as f:
    magic, count, rows, cols = struct.unpack(">IIII", f.read(16))
    images = f.read(n * rows * cols)
with gzip.open(f"{src}/train-labels-idx1-ubyte.gz") as f:
    f.read(8)
    labels = f.read(n)
with open(f"{dst}/images-idx3-ubyte", "wb") as f:
    f.write(struct.pack(">IIII", magic, n, rows, cols) + images)
with open(f"{dst}/labels-idx1-ubyte", "wb") as f:
    f.write(struct.pack(">II", 2049, n) + labels)
PY

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
url="http://127.0.0.1:$port"
token="iot-footprint-benchmark-$$"
STARLING_OPERATOR_TOKEN="$token" RUST_LOG=warn "$target/debug/starling-coordinator" serve --insecure-http \
  --listen "127.0.0.1:$port" --database-url "sqlite://$work/db.sqlite" &
coordinator_pid=$!
for _ in $(seq 100); do curl -sf "$url/healthz" > /dev/null && break; sleep 0.1; done
curl -sf "$url/healthz" > /dev/null || { echo "the coordinator did not start"; exit 1; }
admin() { curl -sf -X "$1" "$url$2" -H "Authorization: Bearer $token" -H 'Content-Type: application/json' ${3:+-d "$3"}; }

layers_2nn='[{"kind":"flatten"},{"kind":"linear","out":200},{"kind":"relu"},{"kind":"linear","out":200},{"kind":"relu"},{"kind":"linear","out":10}]'
layers_cnn='[{"kind":"conv2d","out_channels":32,"kernel":5,"padding":2},{"kind":"relu"},{"kind":"max_pool2d","kernel":2},{"kind":"conv2d","out_channels":64,"kernel":5,"padding":2},{"kind":"relu"},{"kind":"max_pool2d","kernel":2},{"kind":"flatten"},{"kind":"linear","out":512},{"kind":"relu"},{"kind":"linear","out":10}]'

# Makes a cgroup of 256 MiB and one core for one run; prints the directories to enter.
confine() {
  local name="starling-footprint-$$-$1"
  if [ -f /sys/fs/cgroup/cgroup.controllers ] && grep -qw memory /sys/fs/cgroup/cgroup.controllers; then
    local dir="/sys/fs/cgroup/$name"
    mkdir "$dir"
    echo 256M > "$dir/memory.max"
    echo 0 > "$dir/memory.swap.max"
    echo "100000 100000" > "$dir/cpu.max"
    cgroup_dirs+=("$dir")
    echo "$dir"
  else
    local mem="/sys/fs/cgroup/memory/$name" cpu="/sys/fs/cgroup/cpu/$name"
    mkdir "$mem" "$cpu"
    echo $((256 << 20)) > "$mem/memory.limit_in_bytes"
    echo 100000 > "$cpu/cpu.cfs_period_us"
    echo 100000 > "$cpu/cpu.cfs_quota_us"
    cgroup_dirs+=("$mem" "$cpu")
    echo "$mem $cpu"
  fi
}

# One device trains `$1` for one round; `$2` is "confined" to run it in the cgroup.
participate() {
  local model="$1" mode="$2" layers
  [ "$model" = 2nn ] && layers="$layers_2nn" || layers="$layers_cnn"
  local population="$model-$mode"
  admin POST /v1/admin/runs "{\"population\":\"$population\",\"model\":{\"spec\":{\"input\":{\"kind\":\"image\",\"channels\":1,\"height\":28,\"width\":28},\"layers\":$layers},\"init\":{\"kind\":\"seeded\",\"seed\":1}},\"training\":{\"epochs\":1,\"batch_size\":10,\"lr\":0.05},\"cohort_size\":1,\"min_quorum\":1,\"over_selection\":1.0,\"selection_timeout_secs\":30,\"reporting_timeout_secs\":600,\"rounds\":1}" > /dev/null
  local enrollment
  enrollment=$(admin POST /v1/admin/enrollment-tokens "{\"uses\":1,\"populations\":[\"$population\"]}" | python3 -c 'import json, sys; print(json.load(sys.stdin)["token"])')
  local dirs="" cmd=(/usr/bin/time -f "%M %e" -o "$work/time-$population" "$device_bin" participate --url "$url"
    --enrollment-token "$enrollment" --state "$work/state-$population.json" --examples "$work/examples"
    --population "$population" --uploads 1 --max-wait-secs 1 --backend cpu)
  if [ "$mode" = confined ]; then
    dirs=$(confine "$population")
    # The shell enters the cgroup(s) first, then becomes the measured command.
    sh -c 'for d in $1; do echo $$ > "$d/cgroup.procs"; done; shift; exec "$@"' sh "$dirs" "${cmd[@]}" > "$work/log-$population" 2>&1 || {
      echo "$model $mode: FAILED"; cat "$work/log-$population"; return 1; }
  else
    "${cmd[@]}" > "$work/log-$population" 2>&1 || { echo "$model $mode: FAILED"; cat "$work/log-$population"; return 1; }
  fi
  read -r peak_kib wall < "$work/time-$population"
  local extra=""
  if [ -n "$dirs" ]; then
    for d in $dirs; do
      if [ -f "$d/memory.events" ]; then
        extra=" (cgroup: $(grep -E '^(max|oom_kill) ' "$d/memory.events" | tr '\n' ' '))"
      elif [ -f "$d/memory.failcnt" ]; then
        extra=" (cgroup: peak $(( $(cat "$d/memory.max_usage_in_bytes") >> 20 )) MiB, limit hits $(cat "$d/memory.failcnt"), $(grep -w '^oom_kill' "$d/memory.oom_control" || echo 'oom_kill ?'))"
      fi
    done
  fi
  printf '%s %-10s peak RSS %4d MiB, wall %6.1f s%s\n' "$model" "$mode" $((peak_kib >> 10)) "$wall" "$extra"
}

echo "== one round of local training and its upload (enrolment and check-in included)"
for model in 2nn cnn; do
  participate "$model" free
  participate "$model" confined
done

if command -v cargo-bloat > /dev/null; then
  echo "== what the device binary is made of (cargo bloat, the same build unstripped)"
  CARGO_PROFILE_DEVICE_STRIP=false cargo bloat --profile device -p starling-client --no-default-features \
    --features tools --bin starling-client --crates -n 12
else
  echo "(cargo install cargo-bloat for what the binary is made of)"
fi

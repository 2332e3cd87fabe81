#!/usr/bin/env bash
# Runs every cargo-fuzz target for a while (default 60 s each): `fuzz/run.sh [seconds]`.
# Needs a nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`). A crash leaves its
# input in fuzz/artifacts/<target>/; fix the decoder, then copy the input to
# fuzz/regressions/<target>/ so core/tests/fuzz_regressions.rs replays it in every CI run.
set -euo pipefail
cd "$(dirname "$0")"
seconds="${1:-60}"
target_dir="${STARLING_FUZZ_TARGET_DIR:-/var/tmp/starling-fuzz-target}"
for target in fleet_message tensor_payload plan_json secagg_message; do
    mkdir -p "corpus/$target"
    # Seed each corpus with the saved regressions, so a run starts from what was found before.
    if [ -d "regressions/$target" ]; then cp -n regressions/"$target"/* "corpus/$target/" 2>/dev/null || true; fi
    echo "== $target: ${seconds}s"
    cargo +nightly fuzz run "$target" --target-dir "$target_dir" "corpus/$target" -- \
        -max_total_time="$seconds" -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1
done

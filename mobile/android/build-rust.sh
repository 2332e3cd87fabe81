#!/usr/bin/env bash
# Builds libstarling_mobile.so for every Android ABI into starling/src/main/jniLibs with
# cargo-ndk, and generates the Kotlin bindings from the host build of the same library.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$here/../.."
cd "$root"
cargo ndk -t arm64-v8a -t armeabi-v7a -t x86_64 -o "$here/starling/src/main/jniLibs" build --release -p starling-mobile
cargo build -p starling-mobile
target="${CARGO_TARGET_DIR:-$root/target}"
"$target/debug/uniffi-bindgen" generate --library "$target/debug/libstarling_mobile.so" \
  --language kotlin --out-dir "$here/starling/src/main/java"

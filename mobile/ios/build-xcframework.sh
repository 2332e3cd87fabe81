#!/usr/bin/env bash
# Builds the Rust library for iOS devices and the simulator, generates the Swift bindings and
# the C header/modulemap, and packages them as StarlingFFI.xcframework (macOS with Xcode only).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$here/../.."
cd "$root"
target="${CARGO_TARGET_DIR:-$root/target}"
for t in aarch64-apple-ios aarch64-apple-ios-sim; do
  cargo rustc --release -p starling-mobile --lib --target "$t" --crate-type staticlib
done
cargo build -p starling-mobile
gen="$here/build/generated"
rm -rf "$gen" "$here/StarlingFFI.xcframework" && mkdir -p "$gen/include" "$here/Sources/Starling"
"$target/debug/uniffi-bindgen" generate --library "$target/debug/libstarling_mobile.dylib" \
  --language swift --out-dir "$gen"
mv "$gen/starling_mobile.swift" "$here/Sources/Starling/"
mv "$gen/starling_mobileFFI.h" "$gen/include/"
mv "$gen/starling_mobileFFI.modulemap" "$gen/include/module.modulemap"
xcodebuild -create-xcframework \
  -library "$target/aarch64-apple-ios/release/libstarling_mobile.a" -headers "$gen/include" \
  -library "$target/aarch64-apple-ios-sim/release/libstarling_mobile.a" -headers "$gen/include" \
  -output "$here/StarlingFFI.xcframework"

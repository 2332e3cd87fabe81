//! Fuzz target: `starling_core::fuzzing::secagg_message` on arbitrary bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| starling_core::fuzzing::secagg_message(data));

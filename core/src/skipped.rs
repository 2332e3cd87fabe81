//! How a test that cannot run here (no GPU, no NCCL, no `ss`) says so where the test runner
//! reads it: a skipped test passes, so a line on stderr alone is invisible in CI's summary.
//! `cargo xtask test` points `STARLING_SKIP_LOG` at a file, and lists its lines after the
//! suite as the tests that did not run.

use std::io::Write;

/// Records that `test` skipped because `why`: on stderr, and in `STARLING_SKIP_LOG` when set.
pub fn skipped(test: &str, why: &str) {
    eprintln!("{test}: SKIPPED, {why}");
    let Some(path) = std::env::var_os("STARLING_SKIP_LOG") else { return };
    let line = format!("{test}: {}\n", why.replace('\n', " "));
    // One write of one short line to a file opened for appending: lines of tests running in
    // parallel processes do not interleave.
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(line.as_bytes()));
    if let Err(e) = written {
        eprintln!("{test}: cannot record the skip in {}: {e}", path.to_string_lossy());
    }
}

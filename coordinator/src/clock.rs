//! The coordinator's only clock read: wall-clock milliseconds, passed into the sans-IO core.

use starling_core::Millis;

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> Millis {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as Millis)
}

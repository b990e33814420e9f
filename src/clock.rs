//! Time as reports and the state database count it: whole milliseconds
//! since the Unix epoch. The ground floor: it imports nothing of ours.

use std::time::Duration;

/// Now, in milliseconds since the Unix epoch (the one place that reads the
/// wall clock for that).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, millis)
}

/// Whole milliseconds of `d`, saturating.
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

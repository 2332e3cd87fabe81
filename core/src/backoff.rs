//! The workspace's one backoff: how long to wait before each retry of something that failed
//! (a store write, a request to the coordinator). Sans-IO like the rest of core: it says how
//! long, the caller sleeps.

use std::time::Duration;

/// Delays that double from `first` up to `cap`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    next: Duration,
    cap: Duration,
}

impl Backoff {
    /// Delays starting at `first`, doubling, never above `cap`.
    pub fn new(first: Duration, cap: Duration) -> Self {
        Backoff { next: first.min(cap), cap }
    }

    /// The wait before the next try; each call doubles the one after, up to the cap.
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(self.cap);
        delay
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_up_to_the_cap() {
        let mut b = Backoff::new(Duration::from_millis(50), Duration::from_millis(300));
        let delays: Vec<u128> = (0..6).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(delays, [50, 100, 200, 300, 300, 300]);
    }

    #[test]
    fn a_first_delay_above_the_cap_is_the_cap() {
        let mut b = Backoff::new(Duration::from_secs(9), Duration::from_secs(2));
        assert_eq!(b.next_delay(), Duration::from_secs(2));
    }
}

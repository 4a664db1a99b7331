//! Reconnect pacing: exponential backoff with full jitter, reset after a stable connection.

use std::time::Duration;

use rand::RngExt;
use tokio::time::Instant;

/// Reconnect backoff policy. The sleep before retry number `n` (from 0) is uniform in
/// `[0, min(cap, base·2^n)]` ("full jitter"); the counter goes back to 0 once a tunnel stayed up for `stable`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The first ceiling (default 500 ms).
    pub base: Duration,
    /// The largest ceiling (default 30 s).
    pub cap: Duration,
    /// A tunnel up at least this long resets the attempt counter (default 60 s).
    pub stable: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            base: Duration::from_millis(500),
            cap: Duration::from_secs(30),
            stable: Duration::from_secs(60),
        }
    }
}

impl Backoff {
    /// The ceiling for retry number `attempt`: `min(cap, base·2^attempt)`.
    pub fn ceiling(&self, attempt: u32) -> Duration {
        let factor = 1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX);
        self.base
            .checked_mul(factor)
            .map_or(self.cap, |d| d.min(self.cap))
    }

    /// A full-jitter delay for retry number `attempt`, drawn from `rng`.
    pub fn delay(&self, attempt: u32, rng: &mut impl rand::Rng) -> Duration {
        let ceiling = u64::try_from(self.ceiling(attempt).as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(rng.random_range(0..=ceiling))
    }
}

/// Reconnect bookkeeping for one agent: the attempt counter and when the current tunnel came up.
#[derive(Debug)]
pub struct Reconnect {
    policy: Backoff,
    attempt: u32,
    connected_at: Option<Instant>,
}

impl Reconnect {
    /// Starts at attempt 0.
    pub fn new(policy: Backoff) -> Self {
        Self {
            policy,
            attempt: 0,
            connected_at: None,
        }
    }

    /// The number of the next retry (0 after a reset).
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// Records that a tunnel is up now.
    pub fn connected(&mut self) {
        self.connected_at = Some(Instant::now());
    }

    /// Records a failed attempt or a lost tunnel and returns how long to wait before the next attempt. A tunnel
    /// that was up for the stable period resets the counter first.
    pub fn next_delay(&mut self) -> Duration {
        if let Some(since) = self.connected_at.take()
            && since.elapsed() >= self.policy.stable
        {
            self.attempt = 0;
        }
        let delay = self.policy.delay(self.attempt, &mut rand::rng());
        self.attempt = self.attempt.saturating_add(1);
        delay
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceiling_doubles_up_to_the_cap() {
        let b = Backoff::default();
        assert_eq!(b.ceiling(0), Duration::from_millis(500));
        assert_eq!(b.ceiling(1), Duration::from_secs(1));
        assert_eq!(b.ceiling(5), Duration::from_secs(16));
        assert_eq!(b.ceiling(6), Duration::from_secs(30));
        assert_eq!(b.ceiling(40), Duration::from_secs(30));
        assert_eq!(b.ceiling(u32::MAX), Duration::from_secs(30));
    }

    #[test]
    fn delays_stay_within_full_jitter_bounds() {
        let b = Backoff::default();
        let mut rng = rand::rng();
        for attempt in 0..12 {
            let mut seen_low = false;
            let mut seen_high = false;
            for _ in 0..400 {
                let d = b.delay(attempt, &mut rng);
                assert!(d <= b.ceiling(attempt), "attempt {attempt}: {d:?}");
                seen_low |= d < b.ceiling(attempt) / 2;
                seen_high |= d >= b.ceiling(attempt) / 2;
            }
            // Full jitter spreads over the whole range, not just near the ceiling.
            assert!(seen_low && seen_high, "attempt {attempt}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn counter_resets_only_after_a_stable_connection() {
        let policy = Backoff::default();
        let mut r = Reconnect::new(policy);
        for expected in 0..4 {
            assert_eq!(r.attempt(), expected);
            let before = Instant::now();
            let d = r.next_delay();
            assert!(d <= policy.ceiling(expected));
            tokio::time::sleep(d).await;
            assert!(before.elapsed() >= d);
        }
        assert_eq!(r.attempt(), 4);

        // Up, but not for the stable period: the counter keeps growing.
        r.connected();
        tokio::time::advance(policy.stable - Duration::from_millis(1)).await;
        let d = r.next_delay();
        assert!(d <= policy.ceiling(4));
        assert_eq!(r.attempt(), 5);

        // Up for the stable period: back to attempt 0, whose ceiling is the base.
        r.connected();
        tokio::time::advance(policy.stable).await;
        let d = r.next_delay();
        assert!(d <= policy.base);
        assert_eq!(r.attempt(), 1);
    }
}

//! Reconnect pacing: exponential backoff with full jitter, reset after a stable connection, and a gentler
//! schedule right after a tunnel that was up is lost.
//!
//! Why the last part: when a relay restarts under thousands of agents, every agent's first attempts fail while
//! the relay is down, and plain exponential backoff pushes a few unlucky agents' ceilings to 16–30 s — they come
//! back half a minute after everyone else. So for [`Backoff::recovery`] after losing a tunnel the ceiling stops
//! at [`Backoff::recovery_cap`]; and when the relay said how long the fleet should take to come back
//! (`draining`, see [`crate::control::Draining`]), the first attempt is spread uniformly over that window
//! and retries never wait longer than it. A tunnel that keeps flapping gets one such period per
//! [`Backoff::stable`], then the ordinary growth.

use std::time::Duration;

use rand::RngExt;
use tokio::time::Instant;

/// How long a tunnel that got GOAWAY waits for the relay's `draining` message before reconnecting.
pub const DRAINING_WAIT: Duration = Duration::from_secs(2);

/// The longest reconnect window an agent accepts from a relay (a larger one is cut to this).
pub const MAX_RECONNECT_WINDOW: Duration = Duration::from_secs(300);

/// The largest ceiling between attempts of a make-before-break move (see [`Reconnect::move_delay`]).
pub const MOVE_RETRY_CAP: Duration = Duration::from_secs(2);

/// How many failed attempts of one move are paced by [`Reconnect::move_delay`]; later ones wait out the ordinary
/// backoff (a fleet with nowhere to move to is in trouble, not merely unlucky).
pub const MOVE_RETRIES: u32 = 8;

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
    /// How long after losing a tunnel the ceiling stays at most `recovery_cap` (default 60 s).
    pub recovery: Duration,
    /// The largest ceiling during recovery (default 5 s).
    pub recovery_cap: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            base: Duration::from_millis(500),
            cap: Duration::from_secs(30),
            stable: Duration::from_secs(60),
            recovery: Duration::from_secs(60),
            recovery_cap: Duration::from_secs(5),
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
        uniform(self.ceiling(attempt), rng)
    }
}

/// Uniform in `[0, ceiling]`.
fn uniform(ceiling: Duration, rng: &mut impl rand::Rng) -> Duration {
    let ceiling = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
    Duration::from_nanos(rng.random_range(0..=ceiling))
}

/// The period after a lost tunnel.
#[derive(Debug, Clone, Copy)]
struct Recovery {
    started: Instant,
    /// The relay's reconnect window, if it sent one.
    window: Option<Duration>,
}

/// Reconnect bookkeeping for one agent: the attempt counter, when the current tunnel came up, and the recovery
/// period after a lost tunnel.
#[derive(Debug)]
pub struct Reconnect {
    policy: Backoff,
    attempt: u32,
    connected_at: Option<Instant>,
    recovery: Option<Recovery>,
}

impl Reconnect {
    /// Starts at attempt 0.
    pub fn new(policy: Backoff) -> Self {
        Self {
            policy,
            attempt: 0,
            connected_at: None,
            recovery: None,
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

    /// Records that the tunnel that was up is lost and returns how long to wait before the first attempt.
    /// `window` is the relay's reconnect window from its `draining` message, if it sent one (clamped to
    /// [`MAX_RECONNECT_WINDOW`]): the first attempt is then uniform within it.
    pub fn lost(&mut self, window: Option<Duration>) -> Duration {
        let now = Instant::now();
        let stable = self
            .connected_at
            .take()
            .is_some_and(|since| now.duration_since(since) >= self.policy.stable);
        if stable {
            self.attempt = 0;
        }
        let window = window.map(|w| w.min(MAX_RECONNECT_WINDOW));
        // One recovery period per `stable`: a tunnel that flaps falls back to the ordinary growth.
        let fresh = self
            .recovery
            .is_none_or(|r| stable || now.duration_since(r.started) >= self.policy.stable);
        if fresh || window.is_some() {
            self.recovery = Some(Recovery {
                started: now,
                window,
            });
        }
        match window {
            Some(w) => {
                self.attempt = self.attempt.saturating_add(1);
                uniform(w, &mut rand::rng())
            }
            None => self.next_delay(),
        }
    }

    /// Records a failed attempt and returns how long to wait before the next one.
    pub fn next_delay(&mut self) -> Duration {
        let ceiling = self.ceiling_now();
        self.attempt = self.attempt.saturating_add(1);
        uniform(ceiling, &mut rand::rng())
    }

    /// How long to wait before retry number `retry` (from 0) of a make-before-break move off a draining
    /// replica: the policy's first ceilings, held at [`MOVE_RETRY_CAP`], whatever failures were counted before;
    /// the attempt counter is left as it is. During a move the old tunnel still serves and its replica waits for
    /// the move before it ends its watches cleanly, and the attempts that fail are mostly landings the load
    /// balancer sent to that replica before it left rotation, or to one this agent's other tunnel holds: bad
    /// luck, not a fleet in trouble. Waiting out a backoff grown by earlier moves (a rolling restart moves a
    /// tunnel once per replica, well within [`Backoff::stable`]) could outlast the replica's drain timeout.
    pub fn move_delay(&self, retry: u32) -> Duration {
        uniform(
            self.policy.ceiling(retry).min(MOVE_RETRY_CAP),
            &mut rand::rng(),
        )
    }

    /// The ceiling for the next retry: the policy's, held down during recovery (but never below the relay's
    /// window, so retries stay spread over it).
    fn ceiling_now(&self) -> Duration {
        let ceiling = self.policy.ceiling(self.attempt);
        match self.recovery {
            Some(r) if r.started.elapsed() < self.policy.recovery => {
                let held = ceiling.min(self.policy.recovery_cap);
                r.window.map_or(held, |w| held.max(w))
            }
            _ => ceiling,
        }
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

    #[test]
    fn a_move_retries_from_the_first_ceiling_after_any_number_of_failures() {
        let mut r = Reconnect::new(Backoff::default());
        for _ in 0..10 {
            r.next_delay();
        }
        assert_eq!(r.attempt(), 10);
        for retry in 0..MOVE_RETRIES {
            for _ in 0..200 {
                let d = r.move_delay(retry);
                assert!(
                    d <= Backoff::default().ceiling(retry),
                    "retry {retry}: {d:?}"
                );
                assert!(d <= MOVE_RETRY_CAP, "retry {retry}: {d:?}");
            }
        }
        // The slot's own backoff is left where it was.
        assert_eq!(r.attempt(), 10);
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
        let d = r.lost(None);
        assert!(d <= policy.ceiling(4));
        assert_eq!(r.attempt(), 5);

        // Up for the stable period: back to attempt 0, whose ceiling is the base.
        r.connected();
        tokio::time::advance(policy.stable).await;
        let d = r.lost(None);
        assert!(d <= policy.base);
        assert_eq!(r.attempt(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn after_a_lost_tunnel_the_ceiling_is_held_for_the_recovery_period() {
        let policy = Backoff::default();
        let mut r = Reconnect::new(policy);
        r.connected();
        tokio::time::advance(policy.stable).await;
        assert!(r.lost(None) <= policy.base);
        // The relay stays down: the ceiling grows 1, 2, 4 s and then stops at the recovery cap…
        for _ in 0..20 {
            assert!(r.next_delay() <= policy.recovery_cap);
        }
        assert!(r.ceiling_now() == policy.recovery_cap);
        // …until the recovery period is over: then the ordinary ceiling (30 s) applies.
        tokio::time::advance(policy.recovery).await;
        assert_eq!(r.ceiling_now(), policy.cap);
    }

    #[tokio::test(start_paused = true)]
    async fn the_relays_window_spreads_the_first_attempt_and_bounds_the_retries() {
        let policy = Backoff::default();
        let window = Duration::from_secs(10);
        let mut firsts = Vec::new();
        for _ in 0..400 {
            let mut r = Reconnect::new(policy);
            r.connected();
            let d = r.lost(Some(window));
            assert!(d <= window);
            firsts.push(d);
            // Retries while the relay is still down stay spread over the window, not held to the 5 s cap.
            assert_eq!(r.ceiling_now(), window);
        }
        // Uniform over the window: every quarter of it gets some of the agents.
        for q in 0..4u32 {
            let (lo, hi) = (window * q / 4, window * (q + 1) / 4);
            assert!(firsts.iter().any(|d| *d >= lo && *d <= hi), "quarter {q}");
        }
        // A relay cannot park agents for longer than the agent's own bound.
        let mut r = Reconnect::new(policy);
        assert!(r.lost(Some(Duration::from_secs(86_400))) <= MAX_RECONNECT_WINDOW);
    }

    #[tokio::test(start_paused = true)]
    async fn a_flapping_tunnel_gets_one_recovery_period_per_stable_interval() {
        let policy = Backoff::default();
        let mut r = Reconnect::new(policy);
        r.connected();
        let _ = r.lost(None);
        // Up for a second, lost again, many times: the counter keeps growing…
        for _ in 0..8 {
            r.connected();
            tokio::time::advance(Duration::from_secs(1)).await;
            let _ = r.lost(None);
        }
        assert_eq!(r.attempt(), 9);
        // …held at the recovery cap while the first period lasts, then the ordinary growth: no new period.
        assert_eq!(r.ceiling_now(), policy.recovery_cap);
        tokio::time::advance(policy.recovery).await;
        assert_eq!(r.ceiling_now(), policy.cap);
        // A minute after the first period began, a loss may start one new period, which the next flap does
        // not renew.
        r.connected();
        tokio::time::advance(Duration::from_secs(1)).await;
        let _ = r.lost(None);
        r.connected();
        tokio::time::advance(Duration::from_secs(1)).await;
        let _ = r.lost(None);
        assert_eq!(r.ceiling_now(), policy.recovery_cap);
        tokio::time::advance(policy.recovery).await;
        assert_eq!(r.ceiling_now(), policy.cap);
    }
}

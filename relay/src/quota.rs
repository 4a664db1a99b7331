//! Per-client bounds on what users can make a cluster's tunnel hold (issue 10 item 1): concurrent streams per
//! cluster, stream opens per second and early cancellations per second, each per principal and per source IP,
//! and concurrent connections per principal. Over a bound only that client is refused (429 with
//! `Retry-After`); nobody else notices.
//!
//! A *principal* is the credential's subject when the relay validated it (an Entra token's `oid`), else a
//! SHA-256 of the unverified credential: two requests with the same token are the same principal whether or
//! not the token is valid. An *early cancellation* is a stream its user dropped (the connection closed, the
//! HTTP/2 stream reset, the response body dropped unread) within `early_cancel_window` of opening it: the
//! open-and-cancel pattern that costs the tunnel, the agent and the apiserver work for nothing.
//!
//! Not done here: per-IP connection counts, the budgets of agents and users and the idle timeout (the
//! listener's, [`tether_runtime::serve`]), the tunnel's own total stream limit.

use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

/// The maps hash with foldhash, seeded per process: SipHash over these 33-byte keys was ~5 % of the relay's
/// instructions per request (docs/BENCHMARKS.md). A principal key is a SHA-256 and an address is the
/// client's own, so a caller cannot choose colliding keys without knowing the seed.
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// The bounds (flags in [`crate::config::Limits`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ClientLimits {
    /// Most concurrent streams one principal holds to one cluster.
    pub(crate) streams_per_principal: u32,
    /// Most concurrent streams one source IP holds to one cluster.
    pub(crate) streams_per_ip: u32,
    /// Stream opens per second one principal may sustain (token bucket refill).
    pub(crate) principal_opens_per_sec: u32,
    /// Stream opens one principal may make in a burst (token bucket size).
    pub(crate) principal_open_burst: u32,
    /// Stream opens per second one source IP may sustain.
    pub(crate) ip_opens_per_sec: u32,
    /// Stream opens one source IP may make in a burst.
    pub(crate) ip_open_burst: u32,
    /// A stream its user drops within this long of opening it counts as an early cancellation.
    pub(crate) early_cancel_window: Duration,
    /// Early cancellations per second one principal may sustain.
    pub(crate) principal_cancels_per_sec: u32,
    /// Early cancellations one principal may make in a burst.
    pub(crate) principal_cancel_burst: u32,
    /// Early cancellations per second one source IP may sustain.
    pub(crate) ip_cancels_per_sec: u32,
    /// Early cancellations one source IP may make in a burst.
    pub(crate) ip_cancel_burst: u32,
    /// Most concurrent connections one principal holds (a connection counts for the principal of its first
    /// request).
    pub(crate) connections_per_principal: u32,
}

/// Who is asking: the principal and the address it came from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Subject {
    /// A verified subject (`oid`) or the SHA-256 of an unverified credential.
    Principal([u8; 32]),
    /// The source IP.
    Ip(IpAddr),
}

/// A principal key from a credential (hashed, never kept) or a verified subject.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Principal([u8; 32]);

impl Principal {
    /// The principal of an unverified credential: its SHA-256.
    pub(crate) fn of_credential(token: &str) -> Self {
        Self::hashed(b"credential\0", token)
    }

    /// The principal of a verified subject (e.g. an Entra `oid`).
    pub(crate) fn of_subject(subject: &str) -> Self {
        Self::hashed(b"subject\0", subject)
    }

    /// SHA-256 of `domain` then `value`, fed to the hash as they are (no formatted copy).
    fn hashed(domain: &[u8], value: &str) -> Self {
        Self(
            Sha256::new()
                .chain_update(domain)
                .chain_update(value.as_bytes())
                .finalize()
                .into(),
        )
    }
}

/// Which bound refused a stream, and when to come back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Refusal {
    /// What was exceeded (for the message and the log).
    pub(crate) what: &'static str,
    /// When a retry can succeed.
    pub(crate) retry_after: Duration,
}

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

#[derive(Debug, Default)]
struct State {
    /// Concurrent streams per subject, per cluster (two levels so a lookup by `&str` allocates nothing).
    streams: HashMap<Subject, HashMap<Box<str>, u32>>,
    buckets: HashMap<Subject, Bucket>,
    /// Early-cancellation buckets: a cancellation takes a token, time refills them.
    cancels: HashMap<Subject, Bucket>,
    /// Connections per principal.
    connections: HashMap<[u8; 32], u32>,
}

/// The bookkeeping, shared by every user request.
#[derive(Debug)]
pub(crate) struct Quotas {
    limits: ClientLimits,
    state: Mutex<State>,
}

/// Above this many rate buckets, full ones are forgotten (a full bucket is the same as none).
const PRUNE_ABOVE: usize = 100_000;

impl Quotas {
    /// Bookkeeping for `limits`.
    pub(crate) fn new(limits: ClientLimits) -> Arc<Self> {
        Arc::new(Self {
            limits,
            state: Mutex::default(),
        })
    }

    /// Admits one stream of `principal` from `ip` to `cluster` at `now`, or says which bound refuses it. The
    /// slot counts until it is dropped.
    pub(crate) fn admit(
        self: &Arc<Self>,
        principal: &Principal,
        ip: IpAddr,
        cluster: &str,
        now: Instant,
    ) -> Result<StreamSlot, Refusal> {
        let l = &self.limits;
        let p = Subject::Principal(principal.0);
        let i = Subject::Ip(ip.to_canonical());
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let held = |s: &State, subject: &Subject| {
            s.streams
                .get(subject)
                .and_then(|clusters| clusters.get(cluster))
                .copied()
                .unwrap_or(0)
        };
        if held(&state, &p) >= l.streams_per_principal {
            return Err(Refusal {
                what: "concurrent requests of this client to this cluster",
                retry_after: Duration::from_secs(1),
            });
        }
        if held(&state, &i) >= l.streams_per_ip {
            return Err(Refusal {
                what: "concurrent requests from this address to this cluster",
                retry_after: Duration::from_secs(1),
            });
        }
        let cancel_checks = [
            (
                &p,
                l.principal_cancels_per_sec,
                l.principal_cancel_burst,
                "early cancellations of this client (requests dropped right after they were sent)",
            ),
            (
                &i,
                l.ip_cancels_per_sec,
                l.ip_cancel_burst,
                "early cancellations from this address (requests dropped right after they were sent)",
            ),
        ];
        for (subject, rate, burst, what) in cancel_checks {
            let tokens = refill(&state.cancels, subject, rate, burst, now);
            if tokens < 1.0 {
                return Err(Refusal {
                    what,
                    retry_after: wait_for_token(tokens, rate),
                });
            }
        }
        let checks = [
            (
                &p,
                l.principal_opens_per_sec,
                l.principal_open_burst,
                "request rate of this client",
            ),
            (
                &i,
                l.ip_opens_per_sec,
                l.ip_open_burst,
                "request rate from this address",
            ),
        ];
        for (subject, rate, burst, what) in checks {
            let tokens = refill(&state.buckets, subject, rate, burst, now);
            if tokens < 1.0 {
                return Err(Refusal {
                    what,
                    retry_after: wait_for_token(tokens, rate),
                });
            }
        }
        for (subject, rate, burst, _) in checks {
            let tokens = refill(&state.buckets, subject, rate, burst, now) - 1.0;
            state
                .buckets
                .insert(subject.clone(), Bucket { tokens, at: now });
        }
        if state.buckets.len() > PRUNE_ABOVE {
            let limits = *l;
            state.buckets.retain(|subject, b| {
                let (rate, burst) = match subject {
                    Subject::Principal(_) => {
                        (limits.principal_opens_per_sec, limits.principal_open_burst)
                    }
                    Subject::Ip(_) => (limits.ip_opens_per_sec, limits.ip_open_burst),
                };
                let elapsed = now.saturating_duration_since(b.at).as_secs_f64();
                b.tokens + elapsed * f64::from(rate) < f64::from(burst)
            });
        }
        if state.cancels.len() > PRUNE_ABOVE {
            let limits = *l;
            state.cancels.retain(|subject, b| {
                let (rate, burst) = match subject {
                    Subject::Principal(_) => (
                        limits.principal_cancels_per_sec,
                        limits.principal_cancel_burst,
                    ),
                    Subject::Ip(_) => (limits.ip_cancels_per_sec, limits.ip_cancel_burst),
                };
                let elapsed = now.saturating_duration_since(b.at).as_secs_f64();
                b.tokens + elapsed * f64::from(rate) < f64::from(burst)
            });
        }
        let subjects = [p, i];
        for subject in &subjects {
            let clusters = state.streams.entry(subject.clone()).or_default();
            match clusters.get_mut(cluster) {
                Some(n) => *n += 1,
                None => {
                    clusters.insert(cluster.into(), 1);
                }
            }
        }
        Ok(StreamSlot {
            quotas: Arc::clone(self),
            subjects,
            cluster: cluster.into(),
            opened: now,
            armed: AtomicBool::new(false),
        })
    }

    /// Counts one early cancellation against `subjects`, at `now`.
    fn cancelled(&self, subjects: &[Subject; 2], now: Instant) {
        let l = &self.limits;
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        for subject in subjects {
            let (rate, burst) = match subject {
                Subject::Principal(_) => (l.principal_cancels_per_sec, l.principal_cancel_burst),
                Subject::Ip(_) => (l.ip_cancels_per_sec, l.ip_cancel_burst),
            };
            // Floored at zero: past the bound no new stream is admitted, so only streams already open can
            // still add to it, and the wait never grows beyond one token's refill.
            let tokens = (refill(&state.cancels, subject, rate, burst, now) - 1.0).max(0.0);
            state
                .cancels
                .insert(subject.clone(), Bucket { tokens, at: now });
        }
    }

    /// Admits one more connection of `principal`, or refuses it when the principal holds its bound already.
    /// The connection counts until the slot is dropped.
    pub(crate) fn admit_connection(
        self: &Arc<Self>,
        principal: &Principal,
    ) -> Result<ConnectionSlot, Refusal> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let held = state.connections.entry(principal.0).or_insert(0);
        if *held >= self.limits.connections_per_principal {
            if *held == 0 {
                state.connections.remove(&principal.0);
            }
            return Err(Refusal {
                what: "concurrent connections of this client",
                retry_after: Duration::from_secs(1),
            });
        }
        *held += 1;
        Ok(ConnectionSlot {
            quotas: Arc::clone(self),
            principal: principal.0,
        })
    }

    /// Streams `principal` holds to `cluster` now (tests, metrics).
    #[cfg(test)]
    fn held(&self, principal: &Principal, cluster: &str) -> u32 {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state
            .streams
            .get(&Subject::Principal(principal.0))
            .and_then(|clusters| clusters.get(cluster))
            .copied()
            .unwrap_or(0)
    }
}

/// How long until a bucket holding `tokens` that refills at `rate` per second has one again (whole seconds, at
/// least one: `Retry-After` counts in seconds).
fn wait_for_token(tokens: f64, rate: u32) -> Duration {
    let wait = (1.0 - tokens) / f64::from(rate.max(1));
    Duration::from_secs_f64(wait.ceil().max(1.0))
}

fn refill(
    buckets: &HashMap<Subject, Bucket>,
    subject: &Subject,
    rate: u32,
    burst: u32,
    now: Instant,
) -> f64 {
    match buckets.get(subject) {
        None => f64::from(burst),
        Some(b) => {
            let elapsed = now.saturating_duration_since(b.at).as_secs_f64();
            (b.tokens + elapsed * f64::from(rate)).min(f64::from(burst))
        }
    }
}

/// One admitted stream; counts against its principal and address until dropped. Once [armed](Self::arm) (the
/// stream is open), dropping it before [`StreamSlot::finish`] within the early-cancel window counts as an early
/// cancellation.
#[derive(Debug)]
pub(crate) struct StreamSlot {
    quotas: Arc<Quotas>,
    /// The principal and the source address.
    subjects: [Subject; 2],
    cluster: Box<str>,
    opened: Instant,
    armed: AtomicBool,
}

impl StreamSlot {
    /// The stream is open: from now on, dropping the slot unfinished is the user's cancellation.
    pub(crate) fn arm(&self) {
        self.armed.store(true, Ordering::Release);
    }

    /// The exchange ended on its own (response complete, or failed on the relay's or the cluster's side): not
    /// the user's cancellation.
    pub(crate) fn finish(&self) {
        self.armed.store(false, Ordering::Release);
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let now = Instant::now();
        if self.armed.load(Ordering::Acquire)
            && now.saturating_duration_since(self.opened) < self.quotas.limits.early_cancel_window
        {
            self.quotas.cancelled(&self.subjects, now);
        }
        let mut state = self
            .quotas
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for subject in &self.subjects {
            let Some(clusters) = state.streams.get_mut(subject) else {
                continue;
            };
            if let Some(n) = clusters.get_mut(&*self.cluster) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    clusters.remove(&*self.cluster);
                }
            }
            if clusters.is_empty() {
                state.streams.remove(subject);
            }
        }
    }
}

/// One connection of a principal; counts until dropped (with the connection).
#[derive(Debug)]
pub(crate) struct ConnectionSlot {
    quotas: Arc<Quotas>,
    principal: [u8; 32],
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        let mut state = self
            .quotas
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = state.connections.get_mut(&self.principal) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                state.connections.remove(&self.principal);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> ClientLimits {
        ClientLimits {
            streams_per_principal: 2,
            streams_per_ip: 3,
            principal_opens_per_sec: 1,
            principal_open_burst: 100,
            ip_opens_per_sec: 1,
            ip_open_burst: 100,
            early_cancel_window: Duration::from_secs(3600),
            principal_cancels_per_sec: 1,
            principal_cancel_burst: 100,
            ip_cancels_per_sec: 1,
            ip_cancel_burst: 100,
            connections_per_principal: 2,
        }
    }

    #[test]
    fn one_principal_over_its_bound_does_not_touch_another() {
        let q = Quotas::new(limits());
        let (a, b) = (Principal::of_credential("a"), Principal::of_credential("b"));
        let ip: IpAddr = [10, 0, 0, 1].into();
        let other_ip: IpAddr = [10, 0, 0, 2].into();
        let now = Instant::now();
        let s1 = q.admit(&a, ip, "edge", now);
        let s2 = q.admit(&a, other_ip, "edge", now);
        assert!(s1.is_ok() && s2.is_ok());
        let refused = q.admit(&a, other_ip, "edge", now);
        assert_eq!(
            refused.as_ref().err().map(|r| r.retry_after),
            Some(Duration::from_secs(1))
        );
        // Another cluster and another principal are unaffected.
        assert!(q.admit(&a, other_ip, "west", now).is_ok());
        let b1 = q.admit(&b, ip, "edge", now);
        assert!(b1.is_ok());
        // The address bound: ip holds s1 and b1; one more from it is fine, then not.
        let b2 = q.admit(&b, ip, "edge", now);
        assert!(b2.is_ok());
        assert!(
            q.admit(&Principal::of_credential("c"), ip, "edge", now)
                .is_err()
        );
        drop(s1);
        assert_eq!(q.held(&a, "edge"), 1);
        assert!(q.admit(&a, other_ip, "edge", now).is_ok());
        assert_eq!(q.held(&a, "edge"), 1, "the temporary slot was released");
    }

    #[test]
    fn opens_per_second_refill_in_virtual_time() {
        let mut l = limits();
        l.streams_per_principal = 1000;
        l.streams_per_ip = 1000;
        l.principal_open_burst = 3;
        l.principal_opens_per_sec = 2;
        let q = Quotas::new(l);
        let a = Principal::of_credential("a");
        let ip: IpAddr = [10, 0, 0, 1].into();
        let t0 = Instant::now();
        let held: Vec<_> = (0..3)
            .filter_map(|_| q.admit(&a, ip, "edge", t0).ok())
            .collect();
        assert_eq!(held.len(), 3);
        let refused = q.admit(&a, ip, "edge", t0).err();
        assert_eq!(refused.map(|r| r.what), Some("request rate of this client"));
        assert!(
            q.admit(&Principal::of_credential("b"), ip, "edge", t0)
                .is_ok()
        );
        assert!(
            q.admit(&a, ip, "edge", t0 + Duration::from_millis(500))
                .is_ok()
        );
        assert!(
            q.admit(&a, ip, "edge", t0 + Duration::from_millis(500))
                .is_err()
        );
    }

    #[test]
    fn principals_do_not_collide_between_credentials_and_subjects() {
        assert_ne!(Principal::of_credential("x"), Principal::of_subject("x"));
        assert_eq!(Principal::of_credential("x"), Principal::of_credential("x"));
    }

    #[test]
    fn early_cancellations_past_the_burst_refuse_only_that_client() {
        let mut l = limits();
        l.streams_per_principal = 1000;
        l.streams_per_ip = 1000;
        l.principal_cancel_burst = 2;
        let q = Quotas::new(l);
        let (a, b) = (Principal::of_credential("a"), Principal::of_credential("b"));
        let ip: IpAddr = [10, 0, 0, 1].into();
        let now = Instant::now();
        // A slot dropped before its stream opened, or one that finished, is not a cancellation.
        drop(q.admit(&a, ip, "edge", now));
        if let Ok(done) = q.admit(&a, ip, "edge", now) {
            done.arm();
            done.finish();
        }
        for _ in 0..2 {
            let slot = q.admit(&a, ip, "edge", now);
            assert!(slot.is_ok());
            if let Ok(slot) = slot {
                slot.arm();
            }
        }
        let refused = q.admit(&a, ip, "edge", Instant::now()).err();
        assert!(
            refused.is_some_and(|r| r.what.starts_with("early cancellations of this client")),
            "{refused:?}"
        );
        assert!(q.admit(&b, ip, "edge", Instant::now()).is_ok());
        // The bucket refills (one per second here).
        assert!(
            q.admit(&a, ip, "edge", Instant::now() + Duration::from_millis(1100))
                .is_ok()
        );
    }

    #[test]
    fn connections_per_principal_are_counted_until_dropped() {
        let q = Quotas::new(limits());
        let (a, b) = (Principal::of_credential("a"), Principal::of_credential("b"));
        let first = q.admit_connection(&a);
        let second = q.admit_connection(&a);
        assert!(first.is_ok() && second.is_ok());
        let third = q.admit_connection(&a).err();
        assert_eq!(
            third.map(|r| r.what),
            Some("concurrent connections of this client")
        );
        assert!(q.admit_connection(&b).is_ok());
        drop(first);
        assert!(q.admit_connection(&a).is_ok());
    }
}

//! The live tunnels this replica holds: several per cluster (the tunnels of one agent process, or of several
//! agent replicas sharing one identity), at most `max_per_cluster` of them. A new tunnel never displaces an
//! established one: past the bound it is refused before it is upgraded ([`Registry::reserve`]).
//!
//! User requests go to the least-loaded usable tunnel ([`Registry::usable`]): one that has not gone away
//! (GOAWAY from either side: the agent moving it elsewhere, the relay draining) and is not closed. A tunnel
//! that has sent and heard nothing back for a while (a killed agent's QUIC tunnel: no kernel closes it, only
//! the tunnel timeout ends it) goes after the tunnels that answer, whatever its load.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tether_tunnel::Connection;
use time::OffsetDateTime;
use tokio_util::sync::CancellationToken;

/// What the relay learns about a tunnel after it was registered (its control channel's `hello`, renewals),
/// and its state, shared by every clone of the [`Tunnel`].
#[derive(Debug)]
pub(crate) struct TunnelInfo {
    /// The agent's address as this replica sees it.
    pub(crate) peer: SocketAddr,
    /// GOAWAY was sent or received: no new stream goes on this tunnel.
    going_away: AtomicBool,
    /// The agent process's id (`Tether-Agent-Instance`, then `hello.instance`; empty when unknown).
    instance: Mutex<String>,
    /// How many tunnels the agent process keeps (`hello.tunnels`; 0 until hello, read as 1).
    agent_tunnels: AtomicU32,
    /// The certificate the agent holds on this tunnel: the one it was authenticated with, then the one a
    /// renewal on its control channel issued.
    fingerprint: Mutex<String>,
    /// Set once a close after a renewal elsewhere is scheduled (so it is scheduled once).
    replaced: AtomicBool,
    /// Cancelled when the relay drains and asks the agent to move this tunnel (make before break).
    pub(crate) moving: CancellationToken,
    /// Cancelled when the tunnel takes no new streams (GOAWAY either way), or when the replica stops serving
    /// (a child of [`crate::state::Shared::watches_end`]): its JSON watches end cleanly at their next event
    /// boundary, and their clients watch again on a tunnel that takes requests.
    pub(crate) gone: CancellationToken,
    /// What was sent and received when last looked at, for [`TunnelInfo::unanswered_for`].
    liveness: Mutex<Liveness>,
    /// The agent serves streams of kind `HTTP_HEADS` (it said so when it connected).
    http_heads: bool,
    /// The shard that drives the tunnel (`tether_runtime::shards`), when it runs on one: users' connections
    /// to its cluster are served there.
    pub(crate) shard: Option<usize>,
}

/// The tunnel's frame (or datagram) counters when last looked at, and since when it has sent without
/// hearing anything back.
#[derive(Debug, Default)]
struct Liveness {
    seen_in: u64,
    seen_out: u64,
    waiting_since: Option<Instant>,
}

/// How long a tunnel may send without hearing back before requests prefer the cluster's other tunnels: this,
/// or four round trips if longer. A live agent answers every stream it is offered (ACCEPT or a QUIC ACK) and
/// every keepalive within a round trip.
const UNANSWERED_AFTER: Duration = Duration::from_secs(1);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The values hold no invariant a panicking holder could break half-way.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl TunnelInfo {
    /// A tunnel from `peer`, authenticated with the certificate `fingerprint`.
    pub(crate) fn new(
        peer: SocketAddr,
        instance: &str,
        fingerprint: &str,
        gone: CancellationToken,
    ) -> Self {
        Self {
            peer,
            going_away: AtomicBool::new(false),
            instance: Mutex::new(instance.to_owned()),
            agent_tunnels: AtomicU32::new(0),
            fingerprint: Mutex::new(fingerprint.to_owned()),
            replaced: AtomicBool::new(false),
            moving: CancellationToken::new(),
            gone,
            liveness: Mutex::new(Liveness::default()),
            http_heads: false,
            shard: tether_runtime::shards::current(),
        }
    }

    /// Records that the agent serves streams of kind `HTTP_HEADS`.
    pub(crate) fn with_http_heads(mut self, yes: bool) -> Self {
        self.http_heads = yes;
        self
    }

    /// Whether requests go on this tunnel as binary heads (kind `HTTP_HEADS`) rather than HTTP/1.1.
    pub(crate) fn http_heads(&self) -> bool {
        self.http_heads
    }

    /// How long the tunnel has been sending (`frames_out` grew) without receiving anything (`frames_in` did
    /// not), as far as the counters seen at each call tell; zero once anything came in.
    fn unanswered_for(&self, frames_in: u64, frames_out: u64, now: Instant) -> Duration {
        let mut l = lock(&self.liveness);
        if frames_in != l.seen_in {
            l.seen_in = frames_in;
            l.seen_out = frames_out;
            l.waiting_since = None;
        } else if frames_out != l.seen_out {
            l.seen_out = frames_out;
            l.waiting_since.get_or_insert(now);
        }
        l.waiting_since
            .map_or(Duration::ZERO, |since| now.saturating_duration_since(since))
    }

    /// The agent process's id, when known.
    pub(crate) fn instance(&self) -> String {
        lock(&self.instance).clone()
    }

    /// How many tunnels the agent process keeps (at least 1).
    pub(crate) fn agent_tunnels(&self) -> u32 {
        self.agent_tunnels.load(Ordering::Relaxed).max(1)
    }

    /// `hello.tunnels` as the agent said it (0 until hello, or from older agents).
    pub(crate) fn said_tunnels(&self) -> u32 {
        self.agent_tunnels.load(Ordering::Relaxed)
    }

    /// What the agent said in `hello`.
    pub(crate) fn hello(&self, instance: &str, tunnels: u32) {
        if !instance.is_empty() {
            *lock(&self.instance) = instance.to_owned();
        }
        self.agent_tunnels.store(tunnels, Ordering::Relaxed);
    }

    /// The certificate the agent holds on this tunnel.
    pub(crate) fn fingerprint(&self) -> String {
        lock(&self.fingerprint).clone()
    }

    /// A renewal on this tunnel's control channel issued `fingerprint`.
    pub(crate) fn renewed(&self, fingerprint: &str) {
        *lock(&self.fingerprint) = fingerprint.to_owned();
    }

    /// Marks the tunnel as going away; true if it was not already.
    pub(crate) fn mark_going_away(&self) -> bool {
        let first = !self.going_away.swap(true, Ordering::AcqRel);
        self.gone.cancel();
        first
    }

    /// Marks the tunnel as holding a replaced certificate; true the first time.
    pub(crate) fn mark_replaced(&self) -> bool {
        !self.replaced.swap(true, Ordering::AcqRel)
    }

    /// True once GOAWAY was sent or received.
    pub(crate) fn is_going_away(&self) -> bool {
        self.going_away.load(Ordering::Acquire)
    }
}

/// A registered tunnel, with the id that tells it apart from the cluster's other tunnels.
#[derive(Debug, Clone)]
pub(crate) struct Tunnel {
    /// Unique within this replica's life.
    pub(crate) id: u64,
    pub(crate) conn: Connection,
    pub(crate) since: OffsetDateTime,
    /// Cancelled with [`Tunnel::go_away`]: tells the tunnel's own tasks (the control channel) to end, so the
    /// graceful close is not held up by a stream that never finishes by itself.
    pub(crate) draining: CancellationToken,
    pub(crate) info: Arc<TunnelInfo>,
}

impl Tunnel {
    /// GOAWAY: streams in flight may finish, the control channel ends now.
    pub(crate) fn go_away(&self, code: u32, reason: &str) {
        self.info.mark_going_away();
        self.conn.go_away(code, reason);
        self.draining.cancel();
    }

    /// True while new streams may go on this tunnel.
    pub(crate) fn is_usable(&self) -> bool {
        !self.info.is_going_away() && !self.conn.is_closed()
    }

    /// True when the tunnel has sent for longer than [`UNANSWERED_AFTER`] (or four round trips) and heard
    /// nothing back.
    fn is_unanswered(&self, now: Instant) -> bool {
        let stats = self.conn.stats();
        let waited = self
            .info
            .unanswered_for(stats.frames_in, stats.frames_out, now);
        let patience = self
            .conn
            .rtt()
            .map_or(UNANSWERED_AFTER, |rtt| (rtt * 4).max(UNANSWERED_AFTER));
        waited > patience
    }
}

/// Why a tunnel could not be registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Full {
    /// The bound that was reached.
    pub(crate) max: usize,
}

#[derive(Debug, Default)]
struct Entry {
    tunnels: Vec<Tunnel>,
    /// Tunnels authenticated and being upgraded, counted against the bound.
    reserved: usize,
}

/// Cluster name → its tunnels at this replica.
#[derive(Debug)]
pub(crate) struct Registry {
    next_id: AtomicU64,
    /// Whose turn it is among equally loaded tunnels.
    turn: AtomicU64,
    /// The same, for placing connections ([`Registry::shard_of`]): a turn of its own, so that placing a
    /// connection does not take a request's.
    place_turn: AtomicU64,
    max_per_cluster: usize,
    clusters: Mutex<HashMap<String, Entry>>,
    /// How many tunnels are registered (for [`Registry::until_empty`]).
    count: tokio::sync::watch::Sender<usize>,
}

impl Default for Registry {
    fn default() -> Self {
        Self::new(8)
    }
}

/// A place for one tunnel of a cluster, taken before the tunnel is upgraded; given back when dropped unless
/// [`Registry::insert`] used it.
#[derive(Debug)]
pub(crate) struct Reservation {
    registry: Arc<Registry>,
    cluster: String,
    used: bool,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.used {
            let mut map = self.registry.lock();
            if let Some(entry) = map.get_mut(&self.cluster) {
                entry.reserved = entry.reserved.saturating_sub(1);
                if entry.reserved == 0 && entry.tunnels.is_empty() {
                    map.remove(&self.cluster);
                }
            }
        }
    }
}

impl Registry {
    /// A registry holding at most `max_per_cluster` tunnels per cluster (at least 1).
    pub(crate) fn new(max_per_cluster: usize) -> Self {
        Self {
            next_id: AtomicU64::new(1),
            turn: AtomicU64::new(0),
            place_turn: AtomicU64::new(0),
            max_per_cluster: max_per_cluster.max(1),
            clusters: Mutex::default(),
            count: tokio::sync::watch::Sender::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Entry>> {
        lock(&self.clusters)
    }

    /// Takes a place for a new tunnel of `cluster`, or [`Full`] when the cluster holds its bound of tunnels
    /// here already (those registered and those being upgraded).
    pub(crate) fn reserve(self: &Arc<Self>, cluster: &str) -> Result<Reservation, Full> {
        let mut map = self.lock();
        let entry = map.entry(cluster.to_owned()).or_default();
        if entry.tunnels.len() + entry.reserved >= self.max_per_cluster {
            return Err(Full {
                max: self.max_per_cluster,
            });
        }
        entry.reserved += 1;
        Ok(Reservation {
            registry: self.clone(),
            cluster: cluster.to_owned(),
            used: false,
        })
    }

    /// Registers `conn` in the place `reservation` holds; returns it as registered.
    pub(crate) fn insert(
        &self,
        mut reservation: Reservation,
        conn: Connection,
        info: TunnelInfo,
    ) -> Tunnel {
        let tunnel = Tunnel {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            conn,
            since: OffsetDateTime::now_utc(),
            draining: CancellationToken::new(),
            info: Arc::new(info),
        };
        let mut map = self.lock();
        let entry = map.entry(reservation.cluster.clone()).or_default();
        entry.reserved = entry.reserved.saturating_sub(1);
        entry.tunnels.push(tunnel.clone());
        reservation.used = true;
        self.count.send_modify(|n| *n += 1);
        tunnel
    }

    /// Resolves once no tunnel is registered.
    pub(crate) async fn until_empty(&self) {
        let mut count = self.count.subscribe();
        // The sender lives as long as `self`.
        let _ = count.wait_for(|n| *n == 0).await;
    }

    /// The cluster's usable tunnels, least loaded (fewest open streams) first, tunnels that stopped answering
    /// last.
    pub(crate) fn usable(&self, cluster: &str) -> Vec<Tunnel> {
        self.ranked(cluster, &self.turn)
    }

    /// [`Registry::usable`], equally loaded tunnels taking turns by `turn`.
    fn ranked(&self, cluster: &str, turn: &AtomicU64) -> Vec<Tunnel> {
        let now = Instant::now();
        let mut usable: Vec<((bool, usize), Tunnel)> = self
            .lock()
            .get(cluster)
            .map(|e| {
                e.tunnels
                    .iter()
                    .filter(|t| t.is_usable())
                    .map(|t| ((t.is_unanswered(now), t.conn.open_streams()), t.clone()))
                    .collect()
            })
            .unwrap_or_default();
        usable.sort_by_key(|(load, _)| *load);
        // Equally loaded tunnels take turns at the head, so that requests that do not overlap are spread too.
        let ties = usable
            .iter()
            .take_while(|(load, _)| Some(*load) == usable.first().map(|(l, _)| *l))
            .count();
        if ties > 1 {
            let turn = turn.fetch_add(1, Ordering::Relaxed) % ties as u64;
            usable[..ties].rotate_left(turn as usize);
        }
        usable.into_iter().map(|(_, t)| t).collect()
    }

    /// Every tunnel of `cluster` here, usable or not.
    pub(crate) fn tunnels(&self, cluster: &str) -> Vec<Tunnel> {
        self.lock()
            .get(cluster)
            .map(|e| e.tunnels.clone())
            .unwrap_or_default()
    }

    /// The shard that drives `cluster`'s least loaded usable tunnel (equally loaded ones in turn), if it runs on
    /// a shard: with several tunnels, users' connections are spread over their shards by load. With shards, every
    /// tunnel runs on one.
    pub(crate) fn shard_of(&self, cluster: &str) -> Option<usize> {
        self.ranked(cluster, &self.place_turn)
            .iter()
            .find_map(|t| t.info.shard)
    }

    /// Removes the tunnel `id` of `cluster`; true if it was registered.
    pub(crate) fn remove_if(&self, cluster: &str, id: u64) -> bool {
        let mut map = self.lock();
        let Some(entry) = map.get_mut(cluster) else {
            return false;
        };
        let before = entry.tunnels.len();
        entry.tunnels.retain(|t| t.id != id);
        let removed = entry.tunnels.len() < before;
        if entry.tunnels.is_empty() && entry.reserved == 0 {
            map.remove(cluster);
        }
        if removed {
            self.count.send_modify(|n| *n = n.saturating_sub(1));
        }
        removed
    }

    /// Removes and returns every tunnel of `cluster`.
    pub(crate) fn remove(&self, cluster: &str) -> Vec<Tunnel> {
        let mut map = self.lock();
        match map.get_mut(cluster) {
            Some(entry) => {
                let tunnels = std::mem::take(&mut entry.tunnels);
                if entry.reserved == 0 {
                    map.remove(cluster);
                }
                self.count
                    .send_modify(|n| *n = n.saturating_sub(tunnels.len()));
                tunnels
            }
            None => Vec::new(),
        }
    }

    /// The clusters that have at least one tunnel here.
    pub(crate) fn clusters(&self) -> Vec<String> {
        self.lock()
            .iter()
            .filter(|(_, e)| !e.tunnels.is_empty())
            .map(|(c, _)| c.clone())
            .collect()
    }

    /// How many tunnels this replica holds.
    pub(crate) fn len(&self) -> usize {
        *self.count.borrow()
    }

    /// Every tunnel, with its cluster.
    pub(crate) fn all(&self) -> Vec<(String, Tunnel)> {
        self.lock()
            .iter()
            .flat_map(|(cluster, e)| e.tunnels.iter().map(|t| (cluster.clone(), t.clone())))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_count_against_the_bound_and_are_given_back() {
        let registry = Arc::new(Registry::new(2));
        let a = registry.reserve("c");
        let b = registry.reserve("c");
        assert!(a.is_ok() && b.is_ok());
        assert_eq!(registry.reserve("c").err(), Some(Full { max: 2 }));
        // Another cluster has its own bound.
        assert!(registry.reserve("d").is_ok());
        drop(a);
        let c = registry.reserve("c");
        assert!(c.is_ok(), "a dropped reservation frees its place");
        drop((b, c));
        assert!(registry.lock().is_empty(), "nothing left behind");
    }

    #[test]
    fn a_tunnel_that_sends_and_hears_nothing_back_is_unanswered_until_it_hears() {
        let info = TunnelInfo::new(
            "127.0.0.1:1".parse().expect("address"),
            "",
            "",
            CancellationToken::new(),
        );
        let t0 = Instant::now();
        let s = Duration::from_secs;
        assert_eq!(info.unanswered_for(0, 0, t0), Duration::ZERO);
        // Idle both ways: nothing is owed.
        assert_eq!(info.unanswered_for(0, 0, t0 + s(30)), Duration::ZERO);
        // A stream offered (or a keepalive sent) and no answer: the wait counts from when it was seen.
        assert_eq!(info.unanswered_for(0, 1, t0 + s(31)), Duration::ZERO);
        assert_eq!(info.unanswered_for(0, 3, t0 + s(33)), s(2));
        // Anything heard back ends the wait.
        assert_eq!(info.unanswered_for(1, 3, t0 + s(34)), Duration::ZERO);
        assert_eq!(info.unanswered_for(5, 9, t0 + s(40)), Duration::ZERO);
    }
}

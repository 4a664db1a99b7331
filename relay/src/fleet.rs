//! This replica's place in a relay fleet, as state the handlers and services share: its id, the address its
//! peers reach it at, how many replicas were live at the last lease renewal, a short-lived cache of the routes
//! (the tunnels other replicas hold) read from the store, and the peer link's clients. The lease loop and the
//! change feed live in `crate::replicas`, forwarding in `crate::peer_forward`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use crate::peer_client::PeerClient;
use crate::store::TunnelRoute;

/// How long routes read from the store are reused before they are read again (a failure to reach a route
/// forgets them at once).
pub(crate) const ROUTE_CACHE: Duration = Duration::from_secs(1);

/// This replica in the fleet.
#[derive(Debug)]
pub(crate) struct Fleet {
    /// This replica's id (`--replica-id`, or a random one).
    pub(crate) replica_id: String,
    /// Where the other replicas reach this one's peer link, if it has one.
    pub(crate) peer_address: Option<String>,
    /// Replicas whose lease ran at the last renewal, this one included (at least 1).
    live_replicas: AtomicU32,
    /// The same count for the control channels, which tell their agents when it changes (a `welcome` again):
    /// an agent that connected while it was lower keeps fewer tunnels than it should until told.
    live_changes: tokio::sync::watch::Sender<u32>,
    /// Whether a replica other than this one was live, not draining and reachable over the peer link at the
    /// last renewal (a draining replica's agents have somewhere to move to).
    peers_available: AtomicBool,
    /// A write of this replica's tunnels to the store failed: the lease loop writes them all again.
    dirty: AtomicBool,
    /// Routes per cluster, and when they were read.
    routes: Mutex<HashMap<String, (Instant, Vec<TunnelRoute>)>>,
    /// The peer link's clients (to the replicas holding the tunnels this one does not).
    pub(crate) peers: PeerClient,
}

impl Fleet {
    pub(crate) fn new(replica_id: String, peer_address: Option<String>, peers: PeerClient) -> Self {
        Self {
            peers,
            replica_id,
            peer_address,
            live_replicas: AtomicU32::new(1),
            live_changes: tokio::sync::watch::Sender::new(1),
            peers_available: AtomicBool::new(false),
            dirty: AtomicBool::new(false),
            routes: Mutex::default(),
        }
    }

    /// A random replica id: `relay-` and 10 hex digits.
    pub(crate) fn random_id() -> String {
        let mut bytes = [0u8; 5];
        rand::fill(&mut bytes);
        format!("relay-{}", hex::encode(bytes))
    }

    /// How many replicas are live, this one included.
    pub(crate) fn live_replicas(&self) -> u32 {
        self.live_replicas.load(Ordering::Relaxed).max(1)
    }

    /// Wakes when the count of live replicas changes.
    pub(crate) fn subscribe_live(&self) -> tokio::sync::watch::Receiver<u32> {
        self.live_changes.subscribe()
    }

    /// True when another live replica, not draining, has a peer link.
    pub(crate) fn peers_available(&self) -> bool {
        self.peers_available.load(Ordering::Relaxed)
    }

    /// What the last lease renewal saw.
    pub(crate) fn set_live(&self, replicas: u32, peers_available: bool) {
        let replicas = replicas.max(1);
        self.live_replicas.store(replicas, Ordering::Relaxed);
        self.live_changes.send_if_modified(|live| {
            let changed = *live != replicas;
            *live = replicas;
            changed
        });
        self.peers_available
            .store(peers_available, Ordering::Relaxed);
    }

    /// Asks the lease loop to write this replica's tunnels to the store again.
    pub(crate) fn mark_dirty(&self) {
        self.dirty.store(true, Ordering::Release);
    }

    /// Takes the request to write the tunnels again.
    pub(crate) fn take_dirty(&self) -> bool {
        self.dirty.swap(false, Ordering::AcqRel)
    }

    /// The cached routes of `cluster`, if read within [`ROUTE_CACHE`].
    pub(crate) fn cached_routes(&self, cluster: &str) -> Option<Vec<TunnelRoute>> {
        let routes = self.routes.lock().unwrap_or_else(PoisonError::into_inner);
        routes
            .get(cluster)
            .filter(|(at, _)| at.elapsed() < ROUTE_CACHE)
            .map(|(_, r)| r.clone())
    }

    /// Caches `cluster`'s routes as just read.
    pub(crate) fn cache_routes(&self, cluster: &str, routes: Vec<TunnelRoute>) {
        let mut cache = self.routes.lock().unwrap_or_else(PoisonError::into_inner);
        // Bounded by the clusters asked for within the cache's life: drop the stale ones now and then.
        if cache.len() > 1024 {
            cache.retain(|_, (at, _)| at.elapsed() < ROUTE_CACHE);
        }
        cache.insert(cluster.to_owned(), (Instant::now(), routes));
    }

    /// Forgets `cluster`'s cached routes (one of them failed).
    pub(crate) fn forget_routes(&self, cluster: &str) {
        self.routes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(cluster);
    }
}

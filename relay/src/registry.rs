//! The live tunnels: at most one [`Connection`] per cluster name.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use tether_tunnel::Connection;
use time::OffsetDateTime;
use tokio_util::sync::CancellationToken;

/// A registered tunnel, with the id that tells it apart from a newer tunnel of the same cluster.
#[derive(Debug, Clone)]
pub(crate) struct Tunnel {
    pub(crate) id: u64,
    pub(crate) conn: Connection,
    pub(crate) since: OffsetDateTime,
    /// Cancelled with [`Tunnel::go_away`]: tells the tunnel's own tasks (the control channel) to end, so the
    /// graceful close is not held up by a stream that never finishes by itself.
    pub(crate) draining: CancellationToken,
}

impl Tunnel {
    /// GOAWAY: streams in flight may finish, the control channel ends now.
    pub(crate) fn go_away(&self, code: u32, reason: &str) {
        self.conn.go_away(code, reason);
        self.draining.cancel();
    }
}

/// Cluster name → current tunnel.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    next_id: AtomicU64,
    tunnels: Mutex<HashMap<String, Tunnel>>,
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Tunnel>> {
        // The map holds no invariant a panicking holder could break half-way.
        self.tunnels
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Registers `conn` for `cluster`; returns it as registered and the tunnel it replaced, if any.
    pub(crate) fn insert(&self, cluster: &str, conn: Connection) -> (Tunnel, Option<Tunnel>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let tunnel = Tunnel {
            id,
            conn,
            since: OffsetDateTime::now_utc(),
            draining: CancellationToken::new(),
        };
        let old = self.lock().insert(cluster.to_owned(), tunnel.clone());
        (tunnel, old)
    }

    /// The current tunnel of `cluster`.
    pub(crate) fn get(&self, cluster: &str) -> Option<Tunnel> {
        self.lock().get(cluster).cloned()
    }

    /// Removes the tunnel of `cluster` only if it is still the one with `id`; true if it was removed.
    pub(crate) fn remove_if(&self, cluster: &str, id: u64) -> bool {
        let mut map = self.lock();
        if map.get(cluster).is_some_and(|t| t.id == id) {
            map.remove(cluster);
            true
        } else {
            false
        }
    }

    /// Removes and returns the tunnel of `cluster`.
    pub(crate) fn remove(&self, cluster: &str) -> Option<Tunnel> {
        self.lock().remove(cluster)
    }

    /// Every tunnel (for shutdown).
    pub(crate) fn all(&self) -> Vec<Tunnel> {
        self.lock().values().cloned().collect()
    }
}

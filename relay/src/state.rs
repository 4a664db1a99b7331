//! The state every connection, handler and tunnel task shares. It imports no handler: handlers and domain
//! services import it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::HeaderValue;
use rustls::pki_types::CertificateDer;
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::activity::ActivityLog;
use crate::config::Config;
use crate::fleet::Fleet;
use crate::guard_hub::GuardHub;
use crate::identity::AgentCa;
use crate::quota::{ConnectionSlot, Quotas};
use crate::rbac::Rbac;
use crate::registry::Registry;
use crate::store::{Store, TokenHash};

/// State shared by every connection and tunnel task.
pub(crate) struct Shared {
    pub(crate) config: Config,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) registry: Arc<Registry>,
    pub(crate) admin_token_hash: TokenHash,
    pub(crate) agent_ca: AgentCa,
    /// Heartbeats and health waiting for the next batched write.
    pub(crate) activity: ActivityLog,
    /// Tunnel tasks, awaited on shutdown.
    pub(crate) tasks: TaskTracker,
    /// Wakes control channels when their cluster's guard snapshot changed.
    pub(crate) guard: GuardHub,
    /// Validates Entra-style tokens before they enter a tunnel, when configured.
    pub(crate) entra: Option<Arc<tether_auth::Authenticator>>,
    /// Per-principal and per-address bounds of the user endpoint.
    pub(crate) quotas: Arc<Quotas>,
    /// This replica in the fleet, and its clients to its peers.
    pub(crate) fleet: Fleet,
    shutting_down: AtomicBool,
    /// Set on shutdown: the window, in milliseconds, within which agents are told to come back (0: none).
    reconnect_window_ms: AtomicU64,
    /// Cancelled when the drain timeout is reached: what this replica forwards to its peers (watches, upgraded
    /// pipes) is cut, as its tunnels are closed.
    pub(crate) cut: CancellationToken,
    /// Cancelled when this replica stops accepting during a drain: JSON watches end cleanly at their next
    /// event boundary (their clients watch again through the load balancer, at another replica).
    pub(crate) watches_end: CancellationToken,
}

impl Shared {
    pub(crate) fn new(
        config: Config,
        store: Arc<dyn Store>,
        admin_token_hash: TokenHash,
        agent_ca: AgentCa,
        entra: Option<Arc<tether_auth::Authenticator>>,
        registry: Arc<Registry>,
        fleet: Fleet,
    ) -> Self {
        Self {
            fleet,
            quotas: Quotas::new(config.limits.client_limits()),
            config,
            store,
            registry,
            admin_token_hash,
            agent_ca,
            activity: ActivityLog::default(),
            tasks: TaskTracker::new(),
            guard: GuardHub::default(),
            entra,
            shutting_down: AtomicBool::new(false),
            reconnect_window_ms: AtomicU64::new(0),
            cut: CancellationToken::new(),
            watches_end: CancellationToken::new(),
        }
    }

    /// The RBAC domain service over this relay's store and hub.
    pub(crate) fn rbac(&self) -> Rbac<'_> {
        Rbac {
            store: self.store.as_ref(),
            hub: &self.guard,
        }
    }

    /// The reconnect window set on shutdown, if any.
    pub(crate) fn reconnect_window(&self) -> Option<Duration> {
        match self.reconnect_window_ms.load(Ordering::Acquire) {
            0 => None,
            ms => Some(Duration::from_millis(ms)),
        }
    }

    pub(crate) fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Acquire)
    }

    /// Marks the relay as draining: `/readyz` answers 503 and new tunnels are refused from now on.
    pub(crate) fn start_drain(&self) {
        self.shutting_down.store(true, Ordering::Release);
    }

    /// Agents are to come back (or move) within `window`.
    pub(crate) fn set_reconnect_window(&self, window: Duration) {
        self.reconnect_window_ms.store(
            u64::try_from(window.as_millis()).unwrap_or(u64::MAX),
            Ordering::Release,
        );
    }
}

/// What a request handler knows about its connection: the peer, its verified client certificate (only the
/// tunnel endpoint looks at it), the connection's slot under its budget (held by upgraded pipes and tunnels
/// too, so the limit counts them) and the principal it counts for.
#[derive(Debug, Clone)]
pub(crate) struct ConnCtx {
    /// The peer's address.
    pub(crate) peer: SocketAddr,
    /// The client certificate, verified by the agent CA (agents only).
    pub(crate) client_cert: Option<Arc<CertificateDer<'static>>>,
    /// The connection's slot under `max_connections` or `max_agent_connections`.
    pub(crate) permit: Arc<OwnedSemaphorePermit>,
    /// The slot of the principal of the first request to `/clusters/…` on this connection, once it was
    /// admitted (`max_connections_per_principal`); held by every clone, so by the connection and its
    /// upgraded pipes.
    pub(crate) principal: Arc<Mutex<Option<ConnectionSlot>>>,
    /// `X-Forwarded-For` for the requests of this connection: the peer's IP, formatted once.
    pub(crate) forwarded_for: HeaderValue,
}

impl ConnCtx {
    /// The context of a connection the listener accepted.
    pub(crate) fn new(conn: tether_runtime::serve::Conn) -> Self {
        Self {
            peer: conn.peer,
            client_cert: conn.client_cert,
            permit: conn.permit,
            principal: Arc::default(),
            forwarded_for: crate::user_headers::forwarded_for(conn.peer),
        }
    }
}

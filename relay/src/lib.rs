//! The Tether relay: the cloud side of the reverse tunnel.
//!
//! One HTTPS listener (TLS with ALPN `h2` and `http/1.1`, client certificates asked for but optional) serves:
//! - agents: `POST /agent/v1/onboard` (one-time token + CSR → the cluster's client certificate, issued by the
//!   relay's agent CA) and `GET /agent/v1/tunnel` (mTLS with that certificate, then a WebSocket upgrade carrying
//!   a [`tether_tunnel::Connection`], one per cluster, whose first agent-opened stream is the control channel:
//!   heartbeats, metadata, health, identity renewal);
//! - agents over QUIC: a UDP listener on the same port number (`--quic-listen`, `--no-quic`) takes the same
//!   tunnels over QUIC, authenticated by the same checks before the agent may open a stream;
//! - users: `/clusters/NAME/…`, each request forwarded as HTTP/1.1 over a new stream of NAME's tunnel, bodies
//!   streamed, `101` upgrades (exec, attach, port-forward) turned into raw byte pipes;
//! - operators: the admin REST API under `/api/v1/` (bearer admin token): clusters (inventory with
//!   connectivity status, filters, export/import), guard's role definitions, role assignments and deny
//!   assignments per cluster, and the group directory; and the probes `GET /healthz` (liveness) and `GET /readyz` (readiness: store
//!   reachable, not draining).
//!
//! Each cluster's role and deny assignments form a guard snapshot (`tether_auth::Snapshot`) with a version
//! raised on every change; the relay pushes it over the cluster's control channel at `hello` and whenever it
//! changes, and answers the agent's `resolveGroups` from the directory.
//!
//! State lives in a [`store::Store`] (SQLite under the data dir by default); heartbeats are batched in memory
//! and written every few seconds. Without a configured certificate, the relay generates its own CA and server
//! certificate once and reuses them; the agent CA is always its own (`DATA_DIR/agent-ca.pem`).
//!
//! The relay does not authorize users and does not authenticate most of them: the user's `Authorization`
//! header goes through to the cluster's apiserver, which decides. The one exception, when configured
//! ([`EntraConfig`]): a bearer token that claims an Entra issuer must validate at the relay, or the request is
//! refused before it enters a tunnel (the cluster validates it again). The relay does not talk to any
//! apiserver itself, and it does not dial agents: agents dial it.

// Layers, each importing only those below it: listener → router → handlers → domain services (tunnels,
// control, rbac, entra, identity, activity) → state and store.
mod activity;
mod api_error;
mod auth;
mod body;
mod certs;
mod config;
mod control;
mod ends;
mod entra;
mod error;
mod fleet;
mod forward;
mod guard_hub;
mod handlers;
mod identity;
mod listener;
mod peer_client;
mod peer_forward;
mod peer_listener;
mod peer_tls;
mod quic_listener;
mod quota;
mod rbac;
mod registry;
mod replicas;
mod respond;
mod revocation;
mod router;
mod spdy;
mod state;
mod status;
pub mod store;
mod tunnels;
mod user_headers;

use std::future::Future;
use std::path::Path;
use std::sync::Arc;

use tether_runtime::Secret;
use tokio::net::TcpListener;

pub use config::{AGENT_STREAMS, Config, ConfigError, EntraConfig, Limits};
pub use error::RelayError;

use crate::store::{Store, TokenHash};

/// A configured relay, ready to [`serve`](Relay::serve).
pub struct Relay {
    config: Config,
    store: Arc<dyn Store>,
    admin_token: Secret,
    tls: certs::TlsIdentity,
    agent_ca: identity::AgentCa,
    entra: Option<Arc<tether_auth::Authenticator>>,
    registry: Arc<registry::Registry>,
    replica_id: String,
}

/// A read-only view of a relay's live tunnels (from [`Relay::tunnel_stats`]; stays valid while it serves).
#[derive(Clone)]
pub struct TunnelStats(Arc<registry::Registry>);

impl TunnelStats {
    /// How many streams are open on `cluster`'s tunnels at this relay, control streams included; `None` when
    /// the cluster has no tunnel here.
    pub fn open_streams(&self, cluster: &str) -> Option<usize> {
        let tunnels = self.0.tunnels(cluster);
        (!tunnels.is_empty()).then(|| tunnels.iter().map(|t| t.conn.open_streams()).sum())
    }
}

impl std::fmt::Debug for TunnelStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TunnelStats").finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("data_dir", &self.config.data_dir)
            .finish_non_exhaustive()
    }
}

impl Relay {
    /// Validates `config`, creates the data dir (0700), opens and migrates the store, and loads or generates
    /// the TLS identity and the admin token.
    pub async fn new(config: Config) -> Result<Relay, RelayError> {
        config.validate()?;
        create_private_dir(&config.data_dir)?;
        let store = store::open(&config.effective_database_url())
            .await
            .map_err(RelayError::Store)?;
        Self::with_store(config, store).await
    }

    /// Like [`Relay::new`], with a store opened by the caller (another backend, or a shared one in tests).
    pub async fn with_store(config: Config, store: Arc<dyn Store>) -> Result<Relay, RelayError> {
        config.validate()?;
        create_private_dir(&config.data_dir)?;
        tether_runtime::tls::install_crypto_provider();
        let agent_ca = identity::AgentCa::load_or_generate(&config.data_dir)?;
        let tls = certs::load(&config, agent_ca.verifier()?)?;
        let admin_token = load_admin_token(&config)?;
        let entra = match &config.entra {
            Some(entra) => Some(entra::authenticator(entra, store.clone())?),
            None => None,
        };
        let replica_id = config
            .replica_id
            .clone()
            .unwrap_or_else(fleet::Fleet::random_id);
        Ok(Relay {
            replica_id,
            registry: Arc::new(registry::Registry::new(
                config.limits.max_tunnels_per_cluster,
            )),
            config,
            store,
            admin_token,
            tls,
            agent_ca,
            entra,
        })
    }

    /// A view of the live tunnels (open streams per cluster), valid while this relay serves.
    pub fn tunnel_stats(&self) -> TunnelStats {
        TunnelStats(self.registry.clone())
    }

    /// This replica's id in the fleet (`--replica-id`, or the random one it took).
    pub fn replica_id(&self) -> &str {
        &self.replica_id
    }

    /// The token the admin API requires.
    pub fn admin_token(&self) -> &Secret {
        &self.admin_token
    }

    /// The generated CA certificate (PEM; also in `DATA_DIR/ca.pem`), `None` when a certificate was given.
    pub fn ca_pem(&self) -> Option<&str> {
        self.tls.ca_pem.as_deref()
    }

    /// The agent CA (PEM; also in `DATA_DIR/agent-ca.pem`) that issues cluster identities.
    pub fn agent_ca_pem(&self) -> &str {
        self.agent_ca.pem()
    }

    /// Serves on `listener` until `shutdown` resolves, then stops gracefully: no new connections, tunnels
    /// get GOAWAY, in-flight requests get `limits.shutdown_grace` to finish. Unless `no_quic` is set, QUIC
    /// tunnels are accepted on UDP at `quic_listen`, by default at `listener`'s address (same port number).
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), RelayError> {
        self.serve_on(listener, None, shutdown).await
    }

    /// [`Relay::serve`], with the HTTPS listener's connections served on `shards`: each is given the shard with
    /// the fewest TLS handshakes in progress, and its handshake runs there when that shard has none (else on
    /// the workers); a user's connection then moves to the shard that drives the tunnel of the cluster its
    /// first request names, and any other (agents' tunnels among them) stays on the shard it was given. A
    /// request then stays on one thread from the user's connection to the tunnel and back. The accept loop,
    /// the QUIC endpoint, the peer link and the background loops run where this is called. Stop the shards
    /// only after this returns.
    pub async fn serve_on(
        self,
        listener: TcpListener,
        shards: Option<Arc<tether_runtime::shards::Shards>>,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), RelayError> {
        let peer_listener = peer_listener::bind(&self.config).await?;
        let peer_address = peer_listener::advertised(
            &self.config,
            peer_listener.as_ref().and_then(|l| l.local_addr().ok()),
        );
        let identity = peer_tls::ReplicaIdentity::issue(&self.agent_ca, &self.replica_id)?;
        let peers = peer_client::PeerClient::new(&identity, self.config.limits.max_header_bytes)?;
        let peer = match peer_listener {
            Some(listener) => Some((listener, identity.server_config()?)),
            None => None,
        };
        let shared = Arc::new(state::Shared::new(
            self.config,
            self.store,
            TokenHash::of(self.admin_token.expose()),
            self.agent_ca,
            self.entra,
            self.registry,
            fleet::Fleet::new(self.replica_id, peer_address, peers),
        ));
        let quic = quic_listener::bind(
            &shared.config,
            listener.local_addr().ok(),
            self.tls.server_config.clone(),
        )?;
        let listeners = listener::Listeners {
            https: listener,
            tls: self.tls.server_config,
            quic,
            peer,
            shards,
        };
        listener::serve(shared, listeners, shutdown).await
    }
}

fn create_private_dir(dir: &Path) -> Result<(), RelayError> {
    std::fs::create_dir_all(dir).map_err(|e| RelayError::io("cannot create", dir, e))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| RelayError::io("cannot restrict permissions of", dir, e))?;
    }
    Ok(())
}

/// The admin token from the configured file, else from `DATA_DIR/admin-token`, generated the first time.
fn load_admin_token(config: &Config) -> Result<Secret, RelayError> {
    let (path, generate) = match &config.admin_token_file {
        Some(path) => (path.clone(), false),
        None => (config.data_dir.join("admin-token"), true),
    };
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let token = text.trim();
            if token.is_empty() {
                return Err(RelayError::io(
                    "empty admin token file",
                    &path,
                    std::io::Error::new(std::io::ErrorKind::InvalidData, "the file holds no token"),
                ));
            }
            Ok(Secret::new(token))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && generate => {
            let token = auth::generate_token();
            certs::write_file(
                &config.data_dir,
                "admin-token",
                format!("{}\n", token.expose()).as_bytes(),
                0o600,
            )?;
            tracing::info!(path = %path.display(), "generated the admin token");
            Ok(token)
        }
        Err(e) => Err(RelayError::io("cannot read the admin token", &path, e)),
    }
}

/// What the `tether-relay` program runs: builds the relay from `config`, binds `listen`, and serves until
/// `shutdown` resolves.
pub async fn run(
    config: Config,
    listen: std::net::SocketAddr,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RelayError> {
    run_on(config, listen, None, shutdown).await
}

/// [`run`], serving connections on `shards` (see [`Relay::serve_on`]).
pub async fn run_on(
    config: Config,
    listen: std::net::SocketAddr,
    shards: Option<Arc<tether_runtime::shards::Shards>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RelayError> {
    let ca = config.data_dir.join("ca.pem");
    let relay = Relay::new(config).await?;
    if relay.ca_pem().is_some() {
        tracing::info!(ca = %ca.display(), "serving a generated certificate; agents and kubectl must trust this CA");
    }
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|source| RelayError::Io {
            what: "cannot listen on",
            path: listen.to_string(),
            source,
        })?;
    relay.serve_on(listener, shards, shutdown).await
}

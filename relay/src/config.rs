//! The relay's configuration: where it keeps its state, its TLS identity, and the limits it enforces.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, CommandFactory as _, FromArgMatches as _};
use tether_runtime::parse_duration;
use tether_tunnel::{Role, SessionConfig};

/// Streams an agent may have open at once on its tunnel: its one control stream, and room for a few more that
/// the relay refuses (it serves no other kind; the streams that carry users' requests are the relay's, bounded
/// by the agent). QUIC keeps state for every stream the peer may open (quinn makes two map entries per allowed
/// stream when it allows it), so the 1,024 of [`SessionConfig`]'s default cost each idle QUIC tunnel about
/// 70 KB at the relay; the bound also keeps a misbehaving agent from parking streams there.
pub const AGENT_STREAMS: u32 = 8;

/// Everything the relay needs to run. Build it with [`Config::new`] (or parse it with clap: it is the relay's
/// command line, flags and `TETHER_RELAY_*` variables), adjust fields, then [`Config::validate`] (also done by
/// [`crate::Relay::new`]). Every default is written once, on its field.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "tether-relay")]
pub struct Config {
    /// Directory for the database, generated TLS material and admin token (created 0700).
    #[arg(
        long,
        env = "TETHER_RELAY_DATA_DIR",
        default_value = "./tether-relay-data"
    )]
    pub data_dir: PathBuf,
    /// PEM certificate chain to serve (with --tls-key); otherwise a CA and certificate are generated.
    #[arg(long, env = "TETHER_RELAY_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for --tls-cert.
    #[arg(long, env = "TETHER_RELAY_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// Hostname or IP for the generated certificate (repeatable).
    #[arg(
        long = "hostname",
        env = "TETHER_RELAY_HOSTNAMES",
        value_delimiter = ',',
        default_values_t = ["localhost".to_owned(), "127.0.0.1".to_owned(), "::1".to_owned()]
    )]
    pub hostnames: Vec<String>,
    /// File holding the admin token (default: DATA_DIR/admin-token, generated once, 0600).
    #[arg(long, env = "TETHER_RELAY_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,
    /// How long an agent has to accept a request before the user gets a 504 (e.g. 10s, 500ms).
    #[arg(long, env = "TETHER_RELAY_OPEN_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub open_timeout: Duration,
    /// How long a request may wait for its response head (the stream's accept included) before the user
    /// gets a 504 `Status` naming the cluster; kube-apiserver's default. Long-running requests (watch,
    /// `logs -f`, exec/attach/port-forward) are exempt once their head has arrived (e.g. 60s, 1m).
    #[arg(long, env = "TETHER_RELAY_REQUEST_TIMEOUT", default_value = "60s", value_parser = parse_duration)]
    pub request_timeout: Duration,
    /// Database URL: sqlite:PATH (the default, sqlite://DATA_DIR/relay.db) for one relay, or
    /// postgres://USER:PASSWORD@HOST/DB for replicas sharing one store.
    #[arg(long, env = "TETHER_RELAY_DATABASE_URL")]
    pub database_url: Option<String>,
    /// UDP address for QUIC agent tunnels (default: the HTTPS listener's address, same port number).
    #[arg(long, env = "TETHER_RELAY_QUIC_LISTEN")]
    pub quic_listen: Option<std::net::SocketAddr>,
    /// Do not listen for QUIC tunnels: agents connect over WebSocket only.
    #[arg(long, env = "TETHER_RELAY_NO_QUIC")]
    pub no_quic: bool,
    /// Connection and request limits.
    #[command(flatten)]
    pub limits: Limits,
    /// Session settings for agent tunnels (the role is always forced to [`Role::Server`]; the keepalive and
    /// the dead-tunnel timeout come from `tunnel_keepalive` and `tunnel_timeout`, the streams an agent may open
    /// are [`AGENT_STREAMS`]: see [`Config::tunnel_session`]).
    #[arg(skip = SessionConfig::new(Role::Server))]
    pub tunnel: SessionConfig,
    /// A tunnel the agent has been silent on this long gets a PING (e.g. 15s, 1s).
    #[arg(long, env = "TETHER_RELAY_TUNNEL_KEEPALIVE", default_value = "15s", value_parser = parse_duration)]
    pub tunnel_keepalive: Duration,
    /// A tunnel the agent has been silent on this long (PINGs unanswered: a network partition, a frozen
    /// agent) is declared dead: its requests end and new ones get 503 "not connected" (e.g. 45s, 2s).
    #[arg(long, env = "TETHER_RELAY_TUNNEL_TIMEOUT", default_value = "45s", value_parser = parse_duration)]
    pub tunnel_timeout: Duration,
    /// A QUIC tunnel the relay has sent nothing on this long gets a PING (QUIC's own, one small datagram;
    /// e.g. 1s, 250ms). Replaces --tunnel-keepalive for QUIC tunnels.
    #[arg(long, env = "TETHER_RELAY_QUIC_KEEPALIVE", default_value = "1s", value_parser = parse_duration)]
    pub quic_keepalive: Duration,
    /// A QUIC tunnel the agent has been silent on this long is dead: its requests end with a `Status` naming
    /// the cluster (e.g. 3s, 1s). Short, because UDP has no connection reset: a killed agent is noticed only
    /// by its silence (over WebSocket its kernel closes the TCP connection). QUIC uses the shorter of the two
    /// sides' timeouts, and never less than three round trips; a dead peer is noticed about
    /// --quic-keepalive + --quic-timeout after it went silent. Replaces --tunnel-timeout for QUIC tunnels.
    #[arg(long, env = "TETHER_RELAY_QUIC_TIMEOUT", default_value = "3s", value_parser = parse_duration)]
    pub quic_timeout: Duration,
    /// How often agents send heartbeats (whole seconds, e.g. 30s).
    #[arg(long, env = "TETHER_RELAY_HEARTBEAT_INTERVAL", default_value = "30s", value_parser = parse_duration)]
    pub heartbeat_interval: Duration,
    /// A cluster not heard from for this long shows as Offline (e.g. 15m).
    #[arg(long, env = "TETHER_RELAY_OFFLINE_THRESHOLD", default_value = "15m", value_parser = parse_duration)]
    pub offline_threshold: Duration,
    /// Validity of the identity (client certificate) issued to each cluster; agents renew at about 2/3 (e.g. 90d).
    #[arg(long, env = "TETHER_RELAY_IDENTITY_VALIDITY", default_value = "90d", value_parser = parse_duration)]
    pub identity_validity: Duration,
    /// How long a cluster's one-time onboarding token can be redeemed after the cluster was created; later
    /// the agent gets 401 and the cluster must be deleted and created again.
    #[arg(long, env = "TETHER_RELAY_ONBOARDING_TOKEN_TTL", default_value = "24h", value_parser = parse_duration)]
    pub onboarding_token_ttl: Duration,
    /// The newest agent version this relay offers; clusters running an older one show "upgrade available".
    #[arg(long, env = "TETHER_RELAY_LATEST_AGENT_VERSION", default_value = env!("CARGO_PKG_VERSION"))]
    pub latest_agent_version: String,
    /// This replica's id in a relay fleet (letters, digits, '-' and '.'; at most 128 characters): in the
    /// store's replica and tunnel rows, in `welcome`, and in the peer link's certificates
    /// (`tether://replica/ID`). Default: a random id per process (`relay-` and 10 hex digits).
    #[arg(long, env = "TETHER_RELAY_REPLICA_ID")]
    pub replica_id: Option<String>,
    /// Address to serve the peer link on: other replicas of the fleet forward user requests for clusters
    /// whose tunnels this replica holds, over mutual TLS with certificates this replica issues itself from
    /// the agent CA. Without it, this replica still forwards to its peers but receives nothing from them.
    #[arg(long, env = "TETHER_RELAY_PEER_LISTEN")]
    pub peer_listen: Option<std::net::SocketAddr>,
    /// HOST:PORT at which the other replicas reach this replica's peer link (recorded in the store with each
    /// tunnel it holds). Default: --peer-listen, when it names a specific address.
    #[arg(long, env = "TETHER_RELAY_PEER_ADDRESS")]
    pub peer_address: Option<String>,
    /// How long this replica's lease in the store lasts without renewal (renewed every third of it): a
    /// replica that died is ignored by its peers, with the tunnels it held, within this long (e.g. 5s).
    #[arg(long, env = "TETHER_RELAY_LEASE_TTL", default_value = "5s", value_parser = parse_duration)]
    pub lease_ttl: Duration,
    /// After a renewal replaced a cluster's certificate, tunnels still up with the replaced one (the agent's
    /// other tunnels, on this or other replicas) are closed after this grace, which gives the agent time to
    /// move them (make before break). New tunnels with the replaced certificate are refused at once.
    #[arg(long, env = "TETHER_RELAY_REPLACED_IDENTITY_GRACE", default_value = "30s", value_parser = parse_duration)]
    pub replaced_identity_grace: Duration,
    /// Relay-side validation of Entra-style tokens; `None` (no --entra-* flag): every token passes through.
    #[command(flatten)]
    pub entra: Option<EntraConfig>,
}

/// Which Entra-style tokens the relay validates before anything enters a tunnel.
///
/// A bearer token that is a JWT whose `iss` lies under one of the configured authorities
/// (`{authority}/…/v2.0` or `https://sts.windows.net/…/`) must validate (signature, tenant, audience,
/// lifetime: `tether_auth::token::Authenticator`), else the request is refused with 401. Other tokens
/// (Kubernetes service-account tokens, opaque tokens) pass through to the cluster unchanged.
#[derive(Debug, Clone, Default, PartialEq, Eq, Args)]
pub struct EntraConfig {
    /// Entra tenant id whose tokens the relay validates before forwarding (repeatable; with --entra-audience).
    #[arg(
        long = "entra-tenant",
        env = "TETHER_RELAY_ENTRA_TENANTS",
        value_delimiter = ','
    )]
    pub tenants: Vec<String>,
    /// Accepted audience of Entra tokens (repeatable; with --entra-tenant).
    #[arg(
        long = "entra-audience",
        env = "TETHER_RELAY_ENTRA_AUDIENCES",
        value_delimiter = ','
    )]
    pub audiences: Vec<String>,
    /// Base URL of the Entra issuer and its discovery documents (default https://login.microsoftonline.com).
    #[arg(long = "entra-authority", env = "TETHER_RELAY_ENTRA_AUTHORITY")]
    pub authority: Option<String>,
    /// PEM CA trusted for the authority's discovery and keys, besides the public roots (development issuers
    /// and tests).
    #[arg(long = "entra-authority-ca", env = "TETHER_RELAY_ENTRA_AUTHORITY_CA")]
    pub authority_ca: Option<PathBuf>,
}

impl EntraConfig {
    /// The guard crate's token settings for this configuration.
    pub fn token_config(&self) -> tether_auth::TokenConfig {
        let mut config =
            tether_auth::TokenConfig::new(self.tenants.clone(), self.audiences.clone());
        if let Some(authority) = &self.authority {
            config.v2_authority = authority.trim_end_matches('/').to_owned();
        }
        config
    }
}

/// Bounds on what one client can make the relay hold.
#[derive(Debug, Clone, Args)]
pub struct Limits {
    /// Most concurrent connections without a client certificate (users, the admin API, onboarding; upgraded
    /// exec/attach/port-forward sessions included); past it a new one is closed right after its TLS handshake.
    /// Agent tunnels have a budget of their own (--max-agent-connections) that these cannot take.
    #[arg(long, env = "TETHER_RELAY_MAX_CONNECTIONS", default_value_t = 50_000)]
    pub max_connections: usize,
    /// Most concurrent agent connections (a client certificate of the relay's agent CA: tunnels); a budget
    /// user connections cannot take, so idle users never lock a reconnecting agent out. Size it for the
    /// number of clusters times the tunnels each agent holds, with room for reconnects and moves.
    #[arg(
        long,
        env = "TETHER_RELAY_MAX_AGENT_CONNECTIONS",
        default_value_t = 50_000
    )]
    pub max_agent_connections: usize,
    /// Most connections in their TLS handshake at once (agents and users); past it new connections wait in
    /// the kernel's backlog. Each has the TLS handshake timeout (10 s) at most.
    #[arg(long, env = "TETHER_RELAY_MAX_HANDSHAKES", default_value_t = 1_024)]
    pub max_handshakes: usize,
    /// Most connections of one source IP in their TLS handshake at once; past it new ones from that address
    /// wait their turn (within the handshake timeout) without holding a --max-handshakes slot, so one
    /// address cannot hold the handshake slots agents need.
    #[arg(long, env = "TETHER_RELAY_MAX_HANDSHAKES_PER_IP", default_value_t = 64)]
    pub max_handshakes_per_ip: usize,
    /// Most concurrent connections of one source IP (in their handshake, or users'); past it new ones are
    /// closed at accept. Agent tunnels stop counting once their certificate is seen. Fits 4,000 HTTP/1.1
    /// watches from one address (several users behind one NAT).
    #[arg(
        long,
        env = "TETHER_RELAY_MAX_CONNECTIONS_PER_IP",
        default_value_t = 4_000
    )]
    pub max_connections_per_ip: usize,
    /// Most concurrent user connections of one principal (a connection counts for the principal of its first
    /// request to /clusters/…); past it that request gets 429 with Retry-After and an HTTP/1.1 connection is
    /// closed. Fits one principal holding 1,000 watches over HTTP/1.1 (one connection each).
    #[arg(
        long,
        env = "TETHER_RELAY_MAX_CONNECTIONS_PER_PRINCIPAL",
        default_value_t = 2_000
    )]
    pub max_connections_per_principal: u32,
    /// A user connection with no request in flight for this long is closed: HTTP/1.1 keep-alive between
    /// requests, HTTP/2 with no open stream (GOAWAY). Like a load balancer's idle timeout; a watch or any
    /// other long-running request in flight keeps its connection (e.g. 5m, 30s).
    #[arg(long, env = "TETHER_RELAY_USER_IDLE_TIMEOUT", default_value = "5m", value_parser = parse_duration)]
    pub user_idle_timeout: Duration,
    /// Time allowed for the TLS handshake; for QUIC tunnels, for the whole unauthenticated phase (QUIC and
    /// TLS handshake, the agent's HELLO, its authentication).
    #[arg(skip = Duration::from_secs(10))]
    pub tls_handshake_timeout: Duration,
    /// Most QUIC tunnel handshakes in progress (not yet authenticated) at once; past it new attempts are
    /// refused at once (CONNECTION_REFUSED) and agents retry, or fall back to WebSocket.
    #[arg(long, env = "TETHER_RELAY_MAX_QUIC_HANDSHAKES", default_value_t = 256)]
    pub max_quic_handshakes: usize,
    /// Time allowed to receive a request's headers (HTTP/1.1).
    #[arg(skip = Duration::from_secs(30))]
    pub header_read_timeout: Duration,
    /// Largest request head accepted (HTTP/1.1 read buffer; HTTP/2 header list size).
    #[arg(skip = 64 * 1024_usize)]
    pub max_header_bytes: usize,
    /// Most concurrent HTTP/2 streams per client connection. Clients built on hyper (kube-rs) keep every
    /// request on one connection and queue past this, so it must fit a controller holding one watch per
    /// resource type of a large cluster: 1,000 (Go clients open another connection when one is full).
    #[arg(skip = 1_000_u32)]
    pub h2_max_concurrent_streams: u32,
    /// Largest JSON body accepted by the admin and agent endpoints.
    #[arg(skip = 64 * 1024_usize)]
    pub max_control_body_bytes: usize,
    /// On SIGTERM, how long the drain may take (e.g. 30s, 2m): agents are asked to move their tunnels (make
    /// before break, when other replicas are live) or to come back later, requests keep being served, and
    /// open watches, `logs -f` and exec sessions may run until they end; past this, what is left is cut
    /// (watches end with an ERROR event).
    #[arg(long = "drain-timeout", env = "TETHER_RELAY_DRAIN_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,
    /// In a fleet, how long a draining replica keeps accepting new connections at least after `/readyz` went
    /// 503 (e.g. 5s): the time load balancers and Service endpoints take to stop sending users here. Users
    /// reaching it meanwhile are served (through the peer link once its tunnels moved). At most half of
    /// `--drain-timeout`.
    #[arg(long, env = "TETHER_RELAY_DRAIN_DELAY", default_value = "5s", value_parser = parse_duration)]
    pub drain_delay: Duration,
    /// Most tunnels one cluster may hold at this replica (its agent's K tunnels, several agent replicas sharing
    /// one identity, tunnels being moved). A tunnel past it is refused (429, and a warning naming the cluster,
    /// the agent instance and its address); the established ones are never displaced.
    #[arg(
        long,
        env = "TETHER_RELAY_MAX_TUNNELS_PER_CLUSTER",
        default_value_t = 8
    )]
    pub max_tunnels_per_cluster: usize,
    /// Tunnels per second this relay can accept after a restart. On shutdown every agent is told (`draining`)
    /// to come back within TUNNELS / RATE seconds (at least 1 s), at a random moment, so they do not all
    /// reconnect at once.
    #[arg(long, env = "TETHER_RELAY_RECONNECT_RATE", default_value_t = 1_000)]
    pub reconnect_rate: u32,
    /// How often heartbeats and health reports gathered in memory are written to the store, all clusters in
    /// one transaction.
    #[arg(skip = Duration::from_secs(5))]
    pub last_seen_interval: Duration,
    /// Most concurrent requests one principal (token subject, or a hash of an unverified credential) holds to
    /// one cluster; past it that principal gets 429 with Retry-After. Watches count while they run.
    #[arg(
        long,
        env = "TETHER_RELAY_MAX_STREAMS_PER_PRINCIPAL",
        default_value_t = 2_000
    )]
    pub max_streams_per_principal: u32,
    /// Most concurrent requests from one source IP to one cluster (several users behind one NAT share it).
    #[arg(long, env = "TETHER_RELAY_MAX_STREAMS_PER_IP", default_value_t = 4_000)]
    pub max_streams_per_ip: u32,
    /// Requests per second one principal may sustain (token bucket refill).
    #[arg(
        long,
        env = "TETHER_RELAY_PRINCIPAL_REQUEST_RATE",
        default_value_t = 200
    )]
    pub principal_request_rate: u32,
    /// Requests one principal may make in a burst (token bucket size).
    #[arg(
        long,
        env = "TETHER_RELAY_PRINCIPAL_REQUEST_BURST",
        default_value_t = 2_000
    )]
    pub principal_request_burst: u32,
    /// Requests per second one source IP may sustain.
    #[arg(long, env = "TETHER_RELAY_IP_REQUEST_RATE", default_value_t = 500)]
    pub ip_request_rate: u32,
    /// Requests one source IP may make in a burst.
    #[arg(long, env = "TETHER_RELAY_IP_REQUEST_BURST", default_value_t = 4_000)]
    pub ip_request_burst: u32,
    /// A request its user drops (connection closed, HTTP/2 stream reset, response not read to its end) within
    /// this long of the relay opening its stream counts as an early cancellation (e.g. 1s, 500ms).
    #[arg(long, env = "TETHER_RELAY_EARLY_CANCEL_WINDOW", default_value = "1s", value_parser = parse_duration)]
    pub early_cancel_window: Duration,
    /// Early cancellations per second one principal may sustain (token bucket refill); past the burst its new
    /// requests get 429 with Retry-After.
    #[arg(
        long,
        env = "TETHER_RELAY_PRINCIPAL_EARLY_CANCEL_RATE",
        default_value_t = 10
    )]
    pub principal_early_cancel_rate: u32,
    /// Early cancellations one principal may make in a burst (token bucket size).
    #[arg(
        long,
        env = "TETHER_RELAY_PRINCIPAL_EARLY_CANCEL_BURST",
        default_value_t = 100
    )]
    pub principal_early_cancel_burst: u32,
    /// Early cancellations per second one source IP may sustain.
    #[arg(long, env = "TETHER_RELAY_IP_EARLY_CANCEL_RATE", default_value_t = 50)]
    pub ip_early_cancel_rate: u32,
    /// Early cancellations one source IP may make in a burst.
    #[arg(
        long,
        env = "TETHER_RELAY_IP_EARLY_CANCEL_BURST",
        default_value_t = 500
    )]
    pub ip_early_cancel_burst: u32,
}

impl Limits {
    /// The per-client bounds of the user endpoint.
    pub(crate) fn client_limits(&self) -> crate::quota::ClientLimits {
        crate::quota::ClientLimits {
            streams_per_principal: self.max_streams_per_principal,
            streams_per_ip: self.max_streams_per_ip,
            principal_opens_per_sec: self.principal_request_rate,
            principal_open_burst: self.principal_request_burst,
            ip_opens_per_sec: self.ip_request_rate,
            ip_open_burst: self.ip_request_burst,
            early_cancel_window: self.early_cancel_window,
            principal_cancels_per_sec: self.principal_early_cancel_rate,
            principal_cancel_burst: self.principal_early_cancel_burst,
            ip_cancels_per_sec: self.ip_early_cancel_rate,
            ip_cancel_burst: self.ip_early_cancel_burst,
            connections_per_principal: self.max_connections_per_principal,
        }
    }
}

impl Default for Limits {
    /// The defaults written on the fields.
    fn default() -> Self {
        Config::new(PathBuf::new()).limits
    }
}

/// Why a [`Config`] cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Only one of `tls_cert` and `tls_key` was given.
    #[error("--tls-cert and --tls-key must be given together")]
    IncompleteTls,
    /// A hostname for the generated certificate is not a DNS name or an IP address.
    #[error("invalid hostname {0:?}: expected a DNS name or an IP address")]
    InvalidHostname(String),
    /// No hostname for the generated certificate.
    #[error("at least one hostname is needed for the generated certificate")]
    NoHostnames,
    /// The open timeout is zero.
    #[error("open timeout must be greater than zero")]
    ZeroOpenTimeout,
    /// The request timeout is zero.
    #[error("request timeout must be greater than zero")]
    ZeroRequestTimeout,
    /// The database URL names a backend the relay does not support; the text hides any password.
    #[error("{0} (use sqlite:PATH, or postgres://USER@HOST/DB for several replicas)")]
    UnsupportedDatabase(String),
    /// A lifecycle setting (heartbeat interval, offline threshold, identity validity) is out of range.
    #[error("invalid {name}: {why}")]
    InvalidSetting {
        /// Which setting.
        name: &'static str,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The latest agent version is not a semantic version.
    #[error("invalid latest agent version {0:?}: expected a semantic version such as 1.4.0")]
    InvalidAgentVersion(String),
    /// `--replica-id` is not a usable id.
    #[error(
        "invalid replica id {0:?}: use 1 to 128 lowercase letters, digits, '-' and '.', not starting or ending with '-' or '.'"
    )]
    InvalidReplicaId(String),
    /// `--peer-address` is not HOST:PORT.
    #[error("invalid peer address {0}")]
    InvalidPeerAddress(String),
    /// The Entra token settings are unusable.
    #[error("invalid Entra settings: {0}")]
    InvalidEntra(String),
    /// A limit is zero or out of range.
    #[error("invalid limit {name}: {why}")]
    InvalidLimit {
        /// Which limit.
        name: &'static str,
        /// What is wrong with it.
        why: &'static str,
    },
}

impl Config {
    /// The session settings an agent tunnel runs with: `tunnel`, as the server, with the keepalive flags.
    pub fn tunnel_session(&self) -> SessionConfig {
        let mut session = self.tunnel.clone();
        session.role = Role::Server;
        session.max_concurrent_streams = AGENT_STREAMS;
        session.keepalive_interval = self.tunnel_keepalive;
        session.idle_timeout = self.tunnel_timeout;
        session
    }

    /// The session settings a QUIC tunnel runs with: [`Config::tunnel_session`] with the QUIC keepalive and
    /// timeout, and a handshake bounded by the TLS handshake timeout.
    pub fn quic_session(&self) -> SessionConfig {
        let mut session = self.tunnel_session();
        session.keepalive_interval = self.quic_keepalive;
        session.idle_timeout = self.quic_timeout;
        session.handshake_timeout = session
            .handshake_timeout
            .min(self.limits.tls_handshake_timeout);
        session
    }

    /// The defaults written on the fields (the environment is not read), with `data_dir`.
    pub fn new(data_dir: PathBuf) -> Self {
        let command = Self::command().mut_args(|arg| arg.env(None::<&str>));
        let parsed = command
            .try_get_matches_from(["tether-relay"])
            .and_then(|matches| Self::from_arg_matches(&matches));
        match parsed {
            Ok(config) => Config { data_dir, ..config },
            // Every flag has a default and the defaults parse: `defaults_parse` tests it.
            Err(e) => unreachable!("the relay's defaults do not parse: {e}"),
        }
    }

    /// Checks the configuration without touching the filesystem or the network.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            return Err(ConfigError::IncompleteTls);
        }
        if self.tls_cert.is_none() {
            if self.hostnames.is_empty() {
                return Err(ConfigError::NoHostnames);
            }
            for h in &self.hostnames {
                if !valid_hostname(h) {
                    return Err(ConfigError::InvalidHostname(h.clone()));
                }
            }
        }
        if self.open_timeout.is_zero() {
            return Err(ConfigError::ZeroOpenTimeout);
        }
        if self.request_timeout.is_zero() {
            return Err(ConfigError::ZeroRequestTimeout);
        }
        if let Some(url) = &self.database_url {
            crate::store::Backend::of_url(url)
                .map_err(|e| ConfigError::UnsupportedDatabase(e.to_string()))?;
        }
        let l = &self.limits;
        let checks: [(&'static str, bool, &'static str); 15] = [
            (
                "max_tunnels_per_cluster",
                l.max_tunnels_per_cluster == 0,
                "must be at least 1",
            ),
            (
                "drain_timeout",
                l.shutdown_grace.is_zero(),
                "must be greater than zero",
            ),
            (
                "max_quic_handshakes",
                l.max_quic_handshakes == 0,
                "must be at least 1",
            ),
            (
                "max_connections",
                l.max_connections == 0,
                "must be at least 1",
            ),
            (
                "max_agent_connections",
                l.max_agent_connections == 0,
                "must be at least 1",
            ),
            (
                "max_handshakes",
                l.max_handshakes == 0,
                "must be at least 1",
            ),
            (
                "max_handshakes_per_ip",
                l.max_handshakes_per_ip == 0,
                "must be at least 1",
            ),
            (
                "max_connections_per_ip",
                l.max_connections_per_ip == 0,
                "must be at least 1",
            ),
            (
                "user_idle_timeout",
                l.user_idle_timeout.is_zero(),
                "must be greater than zero",
            ),
            (
                "reconnect_rate",
                l.reconnect_rate == 0,
                "must be at least 1",
            ),
            (
                "h2_max_concurrent_streams",
                l.h2_max_concurrent_streams == 0,
                "must be at least 1",
            ),
            (
                "max_header_bytes",
                l.max_header_bytes < 8192,
                "must be at least 8192",
            ),
            (
                "max_control_body_bytes",
                l.max_control_body_bytes == 0,
                "must be at least 1",
            ),
            (
                "tls_handshake_timeout",
                l.tls_handshake_timeout.is_zero(),
                "must be greater than zero",
            ),
            (
                "header_read_timeout",
                l.header_read_timeout.is_zero(),
                "must be greater than zero",
            ),
        ];
        for (name, bad, why) in checks {
            if bad {
                return Err(ConfigError::InvalidLimit { name, why });
            }
        }
        let client_bounds: [(&'static str, u32); 11] = [
            ("max_streams_per_principal", l.max_streams_per_principal),
            ("max_streams_per_ip", l.max_streams_per_ip),
            ("principal_request_rate", l.principal_request_rate),
            ("principal_request_burst", l.principal_request_burst),
            ("ip_request_rate", l.ip_request_rate),
            ("ip_request_burst", l.ip_request_burst),
            (
                "max_connections_per_principal",
                l.max_connections_per_principal,
            ),
            ("principal_early_cancel_rate", l.principal_early_cancel_rate),
            (
                "principal_early_cancel_burst",
                l.principal_early_cancel_burst,
            ),
            ("ip_early_cancel_rate", l.ip_early_cancel_rate),
            ("ip_early_cancel_burst", l.ip_early_cancel_burst),
        ];
        for (name, value) in client_bounds {
            if value == 0 {
                return Err(ConfigError::InvalidLimit {
                    name,
                    why: "must be at least 1",
                });
            }
        }
        if l.last_seen_interval.is_zero() {
            return Err(ConfigError::InvalidLimit {
                name: "last_seen_interval",
                why: "must be greater than zero",
            });
        }
        if self.onboarding_token_ttl.is_zero() {
            return Err(ConfigError::InvalidSetting {
                name: "onboarding token TTL",
                why: "must be greater than zero",
            });
        }
        let settings: [(&'static str, bool, &'static str); 7] = [
            (
                "tunnel keepalive",
                self.tunnel_keepalive < Duration::from_millis(100),
                "must be at least 100ms",
            ),
            (
                "tunnel timeout",
                self.tunnel_timeout <= self.tunnel_keepalive,
                "must be longer than the tunnel keepalive",
            ),
            (
                "QUIC keepalive",
                self.quic_keepalive < Duration::from_millis(100),
                "must be at least 100ms",
            ),
            (
                "QUIC timeout",
                self.quic_timeout <= self.quic_keepalive,
                "must be longer than the QUIC keepalive",
            ),
            (
                "heartbeat interval",
                self.heartbeat_interval < Duration::from_secs(1)
                    || self.heartbeat_interval.subsec_nanos() != 0,
                "must be a whole number of seconds, at least 1s",
            ),
            (
                "offline threshold",
                self.offline_threshold <= self.heartbeat_interval,
                "must be longer than the heartbeat interval",
            ),
            (
                "identity validity",
                self.identity_validity < Duration::from_secs(1)
                    || self.identity_validity > Duration::from_secs(100 * 365 * 24 * 3600),
                "must be between 1s and 100 years",
            ),
        ];
        for (name, bad, why) in settings {
            if bad {
                return Err(ConfigError::InvalidSetting { name, why });
            }
        }
        if let Some(id) = &self.replica_id
            && !valid_replica_id(id)
        {
            return Err(ConfigError::InvalidReplicaId(id.clone()));
        }
        if let Some(address) = &self.peer_address {
            parse_host_port(address).map_err(ConfigError::InvalidPeerAddress)?;
        }
        if self.effective_peer_address().is_none()
            && self.peer_listen.is_some_and(|a| a.ip().is_unspecified())
        {
            return Err(ConfigError::InvalidPeerAddress(
                "missing: --peer-listen binds every address, so --peer-address must say which one the other \
                 replicas reach"
                    .to_owned(),
            ));
        }
        if self.lease_ttl < Duration::from_millis(300) {
            return Err(ConfigError::InvalidSetting {
                name: "lease TTL",
                why: "must be at least 300ms",
            });
        }
        if self.replaced_identity_grace.is_zero() {
            return Err(ConfigError::InvalidSetting {
                name: "replaced identity grace",
                why: "must be greater than zero",
            });
        }
        if semver::Version::parse(self.latest_agent_version.trim_start_matches('v')).is_err() {
            return Err(ConfigError::InvalidAgentVersion(
                self.latest_agent_version.clone(),
            ));
        }
        if let Some(entra) = &self.entra {
            entra
                .token_config()
                .validate()
                .map_err(|e| ConfigError::InvalidEntra(e.to_string()))?;
        }
        Ok(())
    }

    /// The address the other replicas reach this replica's peer link at: `--peer-address`, else
    /// `--peer-listen` when it names a specific address; `None` without a peer link.
    pub fn effective_peer_address(&self) -> Option<String> {
        match (&self.peer_address, self.peer_listen) {
            (Some(address), _) => Some(address.clone()),
            (None, Some(listen)) if !listen.ip().is_unspecified() => Some(listen.to_string()),
            _ => None,
        }
    }

    /// The database URL actually used.
    pub(crate) fn effective_database_url(&self) -> String {
        match &self.database_url {
            Some(url) => url.clone(),
            None => format!("sqlite://{}", self.data_dir.join("relay.db").display()),
        }
    }
}

/// A replica id: 1 to 128 characters of lowercase letters, digits, '-' and '.', not starting or ending with
/// '-' or '.' (it becomes a DNS name in the peer link's TLS and a URI in its certificates).
pub(crate) fn valid_replica_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && id
            .split('.')
            .all(|label| !label.is_empty() && !label.starts_with('-') && !label.ends_with('-'))
}

/// `HOST:PORT` (a DNS name or an IP address, `[v6]:PORT` for IPv6): the host and the port.
pub(crate) fn parse_host_port(address: &str) -> Result<(String, u16), String> {
    let bad = |why: &str| format!("{address:?}: {why} (expected HOST:PORT)");
    if let Ok(addr) = address.parse::<std::net::SocketAddr>() {
        return Ok((addr.ip().to_string(), addr.port()));
    }
    let (host, port) = address.rsplit_once(':').ok_or_else(|| bad("no port"))?;
    let port: u16 = port.parse().map_err(|_| bad("the port is not a number"))?;
    if port == 0 {
        return Err(bad("port 0"));
    }
    if host.contains(':') || !valid_hostname(host) || host.starts_with("*.") {
        return Err(bad("the host is not a DNS name or an IP address"));
    }
    Ok((host.to_owned(), port))
}

/// A DNS name (labels of letters, digits, hyphens, optionally a leading `*.`) or an IP address.
fn valid_hostname(h: &str) -> bool {
    if h.parse::<std::net::IpAddr>().is_ok() {
        return true;
    }
    let name = h.strip_prefix("*.").unwrap_or(h);
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_parse_and_the_command_line_is_sound() {
        Config::command().debug_assert();
        let c = Config::new("/d".into());
        assert_eq!(c.data_dir, PathBuf::from("/d"));
        assert_eq!(c.open_timeout, Duration::from_secs(10));
        assert_eq!(c.request_timeout, Duration::from_secs(60));
        assert_eq!(c.identity_validity, Duration::from_secs(90 * 86_400));
        assert_eq!(c.hostnames, ["localhost", "127.0.0.1", "::1"]);
        assert_eq!(c.limits.max_connections, 50_000);
        assert_eq!(c.limits.max_agent_connections, 50_000);
        assert_eq!(c.limits.user_idle_timeout, Duration::from_secs(300));
        assert_eq!(c.limits.early_cancel_window, Duration::from_secs(1));
        // Issue 17: one principal can hold 1,000 long-running requests to one cluster, over HTTP/1.1 too.
        assert!(c.limits.max_streams_per_principal >= 1_000);
        assert!(c.limits.max_connections_per_principal >= 1_000);
        assert!(c.limits.max_connections_per_ip >= 1_000);
        assert_eq!(c.limits.max_header_bytes, 64 * 1024);
        assert!(c.entra.is_none());
        let c = <Config as clap::Parser>::try_parse_from([
            "r",
            "--entra-tenant",
            "t",
            "--open-timeout",
            "500ms",
            "--request-timeout",
            "2s",
        ]);
        let c = c.map_err(|e| e.to_string());
        assert_eq!(
            c.as_ref()
                .ok()
                .and_then(|c| c.entra.clone())
                .map(|e| e.tenants),
            Some(vec!["t".to_owned()])
        );
        assert_eq!(
            c.as_ref().map(|c| c.request_timeout),
            Ok(Duration::from_secs(2))
        );
        assert_eq!(c.map(|c| c.open_timeout), Ok(Duration::from_millis(500)));
    }

    /// QUIC tunnels find a killed agent only by its silence, so they run with the QUIC liveness flags, never
    /// the WebSocket ones (the listener once took the built-in session defaults: a killed agent's watches
    /// ran on for 60 s).
    #[test]
    fn quic_tunnels_run_with_the_quic_keepalive_and_timeout() {
        let mut c = Config::new("/d".into());
        assert_eq!(
            (c.quic_keepalive, c.quic_timeout),
            (Duration::from_secs(1), Duration::from_secs(3))
        );
        c.quic_keepalive = Duration::from_millis(250);
        c.quic_timeout = Duration::from_secs(1);
        let quic = c.quic_session();
        assert_eq!(quic.keepalive_interval, Duration::from_millis(250));
        assert_eq!(quic.idle_timeout, Duration::from_secs(1));
        assert_eq!(quic.role, Role::Server);
        assert!(quic.handshake_timeout <= c.limits.tls_handshake_timeout);
        let wss = c.tunnel_session();
        assert_eq!(wss.keepalive_interval, c.tunnel_keepalive);
        assert_eq!(wss.idle_timeout, c.tunnel_timeout);
        c.quic_timeout = c.quic_keepalive;
        assert!(
            c.validate().is_err(),
            "a QUIC timeout not longer than its keepalive"
        );
    }

    #[test]
    fn defaults_validate() {
        assert!(Config::new("/tmp/x".into()).validate().is_ok());
    }

    #[test]
    fn tls_cert_and_key_go_together() {
        let mut c = Config::new("/tmp/x".into());
        c.tls_cert = Some("cert.pem".into());
        assert!(matches!(c.validate(), Err(ConfigError::IncompleteTls)));
        c.tls_key = Some("key.pem".into());
        assert!(c.validate().is_ok());
    }

    #[test]
    fn hostnames_are_checked() {
        let mut c = Config::new("/tmp/x".into());
        c.hostnames = vec![
            "relay.example.com".into(),
            "10.0.0.1".into(),
            "*.example.org".into(),
        ];
        assert!(c.validate().is_ok());
        c.hostnames.push("bad host".into());
        assert!(matches!(c.validate(), Err(ConfigError::InvalidHostname(_))));
        c.hostnames.clear();
        assert!(matches!(c.validate(), Err(ConfigError::NoHostnames)));
    }

    #[test]
    fn sqlite_and_postgres_urls_only() {
        let mut c = Config::new("/tmp/x".into());
        c.database_url = Some("postgres://db/tether".into());
        assert!(c.validate().is_ok());
        c.database_url = Some("postgresql://relay@db/tether".into());
        assert!(c.validate().is_ok());
        c.database_url = Some("mysql://relay:hunter2@db/tether".into());
        let err = c
            .validate()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("mysql://relay:***@db/tether"), "{err}");
        assert!(!err.contains("hunter2"), "{err}");
        c.database_url = Some("sqlite::memory:".into());
        assert!(c.validate().is_ok());
        c.database_url = None;
        assert_eq!(c.effective_database_url(), "sqlite:///tmp/x/relay.db");
    }

    #[test]
    fn fleet_settings_are_checked() {
        let c = Config::new("/tmp/x".into());
        assert_eq!(c.lease_ttl, Duration::from_secs(5));
        assert_eq!(c.limits.shutdown_grace, Duration::from_secs(30));
        assert_eq!(c.limits.max_tunnels_per_cluster, 8);
        assert_eq!(c.replaced_identity_grace, Duration::from_secs(30));
        assert!(c.replica_id.is_none() && c.effective_peer_address().is_none());
        let parsed = <Config as clap::Parser>::try_parse_from([
            "r",
            "--replica-id",
            "tether-relay-6d5f7b9c8-x2x9k",
            "--peer-listen",
            "0.0.0.0:9443",
            "--peer-address",
            "10.1.2.3:9443",
            "--lease-ttl",
            "2s",
            "--drain-timeout",
            "2m",
            "--max-tunnels-per-cluster",
            "4",
        ])
        .map_err(|e| e.to_string());
        let parsed = parsed.unwrap_or_else(|e| panic!("{e}"));
        assert!(parsed.validate().is_ok());
        assert_eq!(parsed.limits.shutdown_grace, Duration::from_secs(120));
        assert_eq!(parsed.limits.max_tunnels_per_cluster, 4);
        assert_eq!(
            parsed.effective_peer_address().as_deref(),
            Some("10.1.2.3:9443")
        );

        for bad in [
            "",
            "Relay-A",
            "relay_a",
            "-a",
            "a-",
            "a..b",
            &"x".repeat(129),
        ] {
            let mut c = Config::new("/tmp/x".into());
            c.replica_id = Some(bad.to_owned());
            assert!(
                matches!(c.validate(), Err(ConfigError::InvalidReplicaId(_))),
                "{bad:?}"
            );
        }
        for good in ["relay-0", "r.example", "a"] {
            let mut c = Config::new("/tmp/x".into());
            c.replica_id = Some(good.to_owned());
            assert!(c.validate().is_ok(), "{good:?}");
        }
        for bad in [
            "10.0.0.1",
            "host:",
            "host:x",
            "host:0",
            "bad host:1",
            "[::1]",
        ] {
            let mut c = Config::new("/tmp/x".into());
            c.peer_address = Some(bad.to_owned());
            assert!(
                matches!(c.validate(), Err(ConfigError::InvalidPeerAddress(_))),
                "{bad:?}"
            );
        }
        for good in ["relay-0.relay:9443", "10.0.0.1:9443", "[::1]:9443"] {
            let mut c = Config::new("/tmp/x".into());
            c.peer_address = Some(good.to_owned());
            assert!(c.validate().is_ok(), "{good:?}");
        }
        // Listening on every address needs to say which one peers reach.
        let mut c = Config::new("/tmp/x".into());
        c.peer_listen = Some("0.0.0.0:9443".parse().unwrap_or_else(|e| panic!("{e}")));
        assert!(matches!(
            c.validate(),
            Err(ConfigError::InvalidPeerAddress(_))
        ));
        c.peer_listen = Some("127.0.0.1:9443".parse().unwrap_or_else(|e| panic!("{e}")));
        assert_eq!(
            c.effective_peer_address().as_deref(),
            Some("127.0.0.1:9443")
        );
        let mut c = Config::new("/tmp/x".into());
        c.lease_ttl = Duration::from_millis(100);
        assert!(c.validate().is_err());
        let mut c = Config::new("/tmp/x".into());
        c.limits.shutdown_grace = Duration::ZERO;
        assert!(c.validate().is_err());
    }

    #[test]
    fn limits_are_checked() {
        let mut c = Config::new("/tmp/x".into());
        c.limits.max_connections = 0;
        assert!(matches!(
            c.validate(),
            Err(ConfigError::InvalidLimit {
                name: "max_connections",
                ..
            })
        ));
        let mut c = Config::new("/tmp/x".into());
        c.open_timeout = Duration::ZERO;
        assert!(matches!(c.validate(), Err(ConfigError::ZeroOpenTimeout)));
    }

    #[test]
    fn lifecycle_settings_are_checked() {
        let mut c = Config::new("/tmp/x".into());
        c.heartbeat_interval = Duration::from_millis(1500);
        assert!(matches!(
            c.validate(),
            Err(ConfigError::InvalidSetting {
                name: "heartbeat interval",
                ..
            })
        ));
        c.heartbeat_interval = Duration::from_secs(1);
        c.offline_threshold = Duration::from_secs(1);
        assert!(matches!(
            c.validate(),
            Err(ConfigError::InvalidSetting {
                name: "offline threshold",
                ..
            })
        ));
        c.offline_threshold = Duration::from_secs(3);
        c.identity_validity = Duration::ZERO;
        assert!(matches!(
            c.validate(),
            Err(ConfigError::InvalidSetting {
                name: "identity validity",
                ..
            })
        ));
        c.identity_validity = Duration::from_secs(5);
        assert!(c.validate().is_ok());
        c.latest_agent_version = "latest".into();
        assert!(matches!(
            c.validate(),
            Err(ConfigError::InvalidAgentVersion(_))
        ));
        c.latest_agent_version = "v1.2.3-rc.1".into();
        assert!(c.validate().is_ok());
    }

    #[test]
    fn entra_settings_are_checked() {
        let mut c = Config::new("/tmp/x".into());
        let good = EntraConfig {
            tenants: vec!["72f988bf-86f1-41af-91ab-2d7cd011db47".into()],
            audiences: vec!["api://tether".into()],
            authority: Some("https://127.0.0.1:8443/".into()),
            authority_ca: None,
        };
        c.entra = Some(good.clone());
        assert!(c.validate().is_ok());
        assert_eq!(
            good.token_config().v2_authority,
            "https://127.0.0.1:8443",
            "a trailing slash would make the issuer URL wrong"
        );
        for bad in [
            EntraConfig {
                tenants: vec![],
                ..good.clone()
            },
            EntraConfig {
                audiences: vec![],
                ..good.clone()
            },
            EntraConfig {
                authority: Some("http://idp.example".into()),
                ..good.clone()
            },
            EntraConfig {
                tenants: vec!["has space".into()],
                ..good.clone()
            },
        ] {
            c.entra = Some(bad.clone());
            assert!(
                matches!(c.validate(), Err(ConfigError::InvalidEntra(_))),
                "{bad:?}"
            );
        }
    }
}

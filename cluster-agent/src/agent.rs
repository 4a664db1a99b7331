//! The agent's life: onboard once (key pair + CSR → certificate), dial the relay with that identity (mutual
//! TLS, through the outbound proxy if configured), run the control channel and serve streams, reconnect
//! with backoff, drain on shutdown.

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use tether_runtime::tls;
use tether_tunnel::proxy::ProxyConfig;
use tether_tunnel::ws::{self, ConnectError};
use tether_tunnel::{Connection, Incoming, Role, SessionConfig, code, kind};
use time::OffsetDateTime;
use tokio::task::JoinSet;

use crate::auth_proxy::{AuthProxy, AuthProxyError};
use crate::config::{Config, ConfigError};
use crate::control;
use crate::directory::RelayDirectory;
use crate::forward::{Upstream, UpstreamError, serve_stream};
use crate::guard_push;
use crate::identity::{self, Identity, IdentityError};
use crate::metadata;
use crate::onboard::{OnboardError, Onboarding};
use crate::probes::{self, Probes};
use crate::state_secret::{Acquired, SecretStore, StateSecretError};
use crate::store::IdentityStore;
use tether_api::reconnect::{DRAINING_WAIT, Reconnect};

/// The Kubernetes `Status` reason with which the relay refuses an expired identity.
pub const IDENTITY_EXPIRED_REASON: &str = "IdentityExpired";

/// Most streams the relay may open at once on this agent's tunnel (the protocol's default is 1024): one
/// tunnel carries every user's requests to the cluster, long-running ones (watches, `logs -f`, exec) included,
/// and must carry at least 10,000 (issue 17). A stream costs a few KiB until it carries data.
pub(crate) const TUNNEL_MAX_STREAMS: u32 = 16_384;

/// Why the agent stopped. Every variant is fatal: retrying with the same configuration cannot help.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The configuration is not usable.
    #[error("invalid configuration: {0}")]
    Config(#[from] ConfigError),
    /// The kubeconfig (or in-cluster configuration) could not be loaded.
    #[error("cannot load the Kubernetes configuration: {0}")]
    KubeConfig(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The apiserver client could not be built.
    #[error("cannot set up the apiserver client: {0}")]
    Upstream(#[from] UpstreamError),
    /// The agent's own Kubernetes client could not be built.
    #[error("cannot build the agent's Kubernetes client: {0}")]
    KubeClient(#[source] kube::Error),
    /// The relay CA, the proxy CA or the identity could not be made into a TLS configuration.
    #[error("cannot set up TLS to the relay: {0}")]
    RelayTls(#[from] tls::TlsError),
    /// The identity files could not be read or written, or a key could not be generated.
    #[error(transparent)]
    Identity(#[from] IdentityError),
    /// The relay refused the onboarding token.
    #[error(
        "the relay refused the onboarding token (HTTP {status}): {message}; get a new one with `tether cluster connect`"
    )]
    OnboardingRefused {
        /// HTTP status.
        status: StatusCode,
        /// The relay's message.
        message: String,
    },
    /// The relay rejected the cluster's identity: the cluster was deleted (its identity revoked), or the
    /// certificate is not this cluster's.
    #[error(
        "the relay rejected this cluster's identity (HTTP {status}): it was deleted or revoked; register it again"
    )]
    CredentialRejected {
        /// HTTP status (401 or 403).
        status: StatusCode,
    },
    /// The authentication proxy could not be set up (Entra settings, authority CA).
    #[error("cannot set up the authentication proxy: {0}")]
    AuthProxy(#[from] AuthProxyError),
    /// The guard CA could not be read or used.
    #[error("cannot set up TLS to guard: {0}")]
    GuardTls(#[source] tls::TlsError),
    /// The state Secret (`--state-secret`) holds no usable identity or could not be written.
    #[error(transparent)]
    StateSecret(#[from] StateSecretError),
    /// The probe port (`--health-listen`) could not be bound.
    #[error("cannot listen for probes on {addr}: {source}")]
    HealthListen {
        /// The address.
        addr: std::net::SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The cluster's certificate expired (the agent could not renew it in time, e.g. it was offline).
    #[error(
        "this cluster's identity expired: delete it at the relay and connect it again ({message})"
    )]
    IdentityExpired {
        /// The relay's message.
        message: String,
    },
}

type Shutdown = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Runs the agent until `shutdown` resolves (then drains and returns `Ok`) or a fatal error.
pub async fn run(
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), AgentError> {
    config.validate()?;
    tls::install_crypto_provider();
    let tunnel_url = config.tunnel_url()?;
    let onboard_url = config.onboard_url()?;
    // Dropped when `run` returns: /livez then answers 503 (or nothing at all once the probe server is gone).
    let (probes, _liveness) = Probes::start();
    let _probe_server = match config.health_listen {
        Some(addr) => {
            let listener = probes::bind(addr)
                .await
                .map_err(|source| AgentError::HealthListen { addr, source })?;
            tracing::info!(%addr, "serving probes (/readyz, /livez, /metrics)");
            Some(probes::serve(listener, probes.clone()))
        }
        None => None,
    };

    let mut kube_config = load_kube_config(config.kubeconfig.as_deref()).await?;
    // The apiserver is reached directly, like the forwarded requests (the proxy settings are for the
    // relay): kube-rs would otherwise take HTTPS_PROXY for its own connections too.
    if kube_config.proxy_url.take().is_some() {
        tracing::info!(
            "ignoring the proxy for the apiserver (from the kubeconfig or HTTPS_PROXY): only the relay is reached through the proxy"
        );
    }
    // Group overages are resolved through the relay, over whichever control channel is up.
    let directory = Arc::new(RelayDirectory::default());
    let auth_proxy = match &config.entra {
        Some(entra) => {
            let resolver: Arc<dyn tether_auth::token::GroupResolver> = directory.clone();
            Some(AuthProxy::new(entra, Some(resolver))?)
        }
        None => None,
    };
    let upstream =
        Upstream::from_kube_config_with(&kube_config, auth_proxy, config.upstream.clone())?;
    probes.set_upstream(&upstream);
    // Dropping the pusher (when `run` returns) stops it.
    let (snapshots, _pusher) = match &config.guard {
        Some(guard) => {
            let (sink, pusher) = guard_push::spawn(guard).map_err(AgentError::GuardTls)?;
            (Some(sink), Some(pusher))
        }
        None => (None, None),
    };
    // Names the agent's own requests in the apiserver's audit log (forwarded requests keep the user's).
    kube_config.headers.push((
        http::header::USER_AGENT,
        HeaderValue::from_static(concat!("tether-agent/", env!("CARGO_PKG_VERSION"))),
    ));
    // The agent's own identity, kept apart from forwarding (which carries only the users' credentials): it
    // reads the cluster's metadata.
    let agent_client = kube::Client::try_from(kube_config).map_err(AgentError::KubeClient)?;

    let relay_ca = config.relay_ca.as_deref().map(tls::read_file).transpose()?;
    let proxy_ca = config.proxy_ca.as_deref().map(tls::read_file).transpose()?;
    let relay_tls = RelayTls { relay_ca, proxy_ca };
    let proxy_config = config.proxy_config();
    let proxy = proxy_config.as_ref();

    tracing::info!(
        relay = %config.relay_url,
        cluster = %config.cluster,
        apiserver = %upstream.base(),
        proxy = %proxy.map_or_else(|| "none".to_owned(), |p| p.proxy.to_string()),
        auth_proxy = upstream.impersonates(),
        guard = %config.guard.as_ref().map_or("none", |g| g.url.as_str()),
        "agent starting"
    );
    let mut shutdown: Shutdown = Box::pin(shutdown);
    let mut reconnect = Reconnect::new(config.backoff);

    let store = Arc::new(match &config.state_secret {
        Some(secret) => {
            IdentityStore::Secret(Box::new(SecretStore::new(agent_client.clone(), secret)))
        }
        None => IdentityStore::Dir(config.state_dir.clone()),
    });
    let Some(identity) = ensure_identity(
        &config,
        &store,
        &onboard_url,
        &relay_tls.config(None)?,
        proxy,
        &mut reconnect,
        &mut shutdown,
    )
    .await?
    else {
        tracing::info!("shut down before onboarding finished");
        return Ok(());
    };
    let metadata = metadata::spawn(agent_client);
    let mut state = control::State::new(store, identity, metadata);
    state.directory = directory;
    state.snapshots = snapshots;
    let headers = tunnel_headers(&config.cluster);

    // Every stream task, across tunnels: a stream of a tunnel the relay is retiring still drains on shutdown.
    let mut streams = JoinSet::new();
    let mut last_failure: Option<String> = None;
    loop {
        if last_failure.is_none() {
            tracing::info!(url = %tunnel_url, identity = %state.identity.fingerprint, "connecting to the relay");
        }
        // Built per attempt: a renewal replaces the identity.
        let tls = relay_tls.config(Some(&state.identity))?;
        let mut session = SessionConfig::new(Role::Client);
        session.max_concurrent_streams = TUNNEL_MAX_STREAMS;
        session.keepalive_interval = config.tunnel_keepalive;
        session.idle_timeout = config.tunnel_timeout;
        let connecting = tokio::time::timeout(
            config.connect_timeout,
            ws::connect_with_proxy(&tunnel_url, tls, headers.clone(), session, proxy),
        );
        let result = tokio::select! {
            result = connecting => result,
            () = shutdown.as_mut() => {
                tracing::info!("shut down while connecting");
                drain(&mut streams, config.drain_timeout).await;
                return Ok(());
            }
        };
        let failure = match result {
            Ok(Ok(conn)) => {
                state.connections += 1;
                tracing::info!(
                    identity = %state.identity.fingerprint,
                    reconnects = state.connections - 1,
                    "connected to the relay"
                );
                last_failure = None;
                reconnect.connected();
                probes.set_tunnel_up(true);
                let ended = serve(
                    conn,
                    &upstream,
                    &probes,
                    &mut streams,
                    &mut shutdown,
                    config.drain_timeout,
                    &mut state,
                )
                .await;
                probes.set_tunnel_up(false);
                match ended {
                    Ended::Shutdown => return Ok(()),
                    Ended::Disconnected(reason) => {
                        let delay = reconnect.lost(state.reconnect_window.take());
                        tracing::warn!(%reason, retry_in = ?delay, "disconnected from the relay");
                        delay
                    }
                }
            }
            Ok(Err(ConnectError::Rejected { status, body }))
                if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN =>
            {
                let error = match expired_reason(status, &body) {
                    Some(message) => AgentError::IdentityExpired { message },
                    None => AgentError::CredentialRejected { status },
                };
                tracing::error!(%error, relay_says = %body, "giving up");
                return Err(error);
            }
            Ok(Err(e)) => note_failure(&mut last_failure, &mut reconnect, &crate::error_chain(&e)),
            Err(_) => note_failure(
                &mut last_failure,
                &mut reconnect,
                &format!("timed out after {:?}", config.connect_timeout),
            ),
        };
        tokio::select! {
            () = tokio::time::sleep(failure) => {}
            () = shutdown.as_mut() => {
                tracing::info!("shut down while waiting to reconnect");
                drain(&mut streams, config.drain_timeout).await;
                return Ok(());
            }
        }
    }
}

/// The relay's message when a 401 says the identity expired (a `Status` with reason `IdentityExpired`).
fn expired_reason(status: StatusCode, body: &str) -> Option<String> {
    if status != StatusCode::UNAUTHORIZED {
        return None;
    }
    let parsed = serde_json::from_str::<serde_json::Value>(body).ok();
    let reason = parsed
        .as_ref()
        .and_then(|v| v.get("reason"))
        .and_then(|r| r.as_str());
    let expired = match reason {
        Some(reason) => reason == IDENTITY_EXPIRED_REASON,
        // A body cut short (or not JSON) still names the reason.
        None => body.contains(IDENTITY_EXPIRED_REASON),
    };
    expired.then(|| crate::onboard::status_message(body.as_bytes()))
}

/// TLS material for the relay: its CA (or the webpki roots) plus the proxy's CA, and the identity.
struct RelayTls {
    relay_ca: Option<Vec<u8>>,
    proxy_ca: Option<Vec<u8>>,
}

impl RelayTls {
    fn config(
        &self,
        identity: Option<&Identity>,
    ) -> Result<Arc<rustls::ClientConfig>, tls::TlsError> {
        tls::client_config_with(&tls::ClientOptions {
            ca_pem: self.relay_ca.as_deref(),
            extra_ca_pem: self.proxy_ca.as_deref(),
            identity: identity.map(|id| tls::ClientIdentity {
                cert_pem: id.certificate.as_bytes(),
                key_pem: id.key.expose().as_bytes(),
            }),
            alpn: &[b"http/1.1"],
        })
    }
}

/// Logs a failed attempt (once per distinct error, then quietly) and returns the delay before the next.
fn note_failure(last: &mut Option<String>, reconnect: &mut Reconnect, error: &str) -> Duration {
    let delay = reconnect.next_delay();
    if last.as_deref() == Some(error) {
        tracing::debug!(%error, retry_in = ?delay, attempt = reconnect.attempt(), "cannot connect to the relay");
    } else {
        tracing::warn!(%error, retry_in = ?delay, "cannot connect to the relay");
        *last = Some(error.to_string());
    }
    delay
}

/// Reads the Secret until it holds a usable identity (`Acquired::Identity`) or this agent holds the onboarding
/// claim (`Acquired::Claimed`), waiting while another agent onboards. Apiserver errors are retried with the
/// reconnect pacing. `None` when shutdown came first.
async fn acquire_from_secret(
    config: &Config,
    secret: &SecretStore,
    usable: &impl Fn(&Identity) -> bool,
    reconnect: &mut Reconnect,
    shutdown: &mut Shutdown,
) -> Result<Option<Acquired>, AgentError> {
    let mut waiting_logged = false;
    loop {
        let delay = match secret
            .acquire(&config.relay_url, &config.cluster, usable)
            .await
        {
            Ok(Acquired::Wait) => {
                if !waiting_logged {
                    tracing::info!(secret = %secret.name(), "another agent is onboarding this cluster; waiting for the identity it stores");
                    waiting_logged = true;
                }
                SECRET_POLL
            }
            Ok(done) => return Ok(Some(done)),
            Err(e @ StateSecretError::Api { .. }) => {
                let delay = reconnect.next_delay();
                tracing::warn!(error = %crate::error_chain(&e), retry_in = ?delay, "cannot use the state Secret");
                delay
            }
            Err(e) => return Err(e.into()),
        };
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = shutdown.as_mut() => return Ok(None),
        }
    }
}

/// How often an agent waiting for another's onboarding reads the Secret.
const SECRET_POLL: Duration = Duration::from_millis(500);

/// The stored identity, or a new one from onboarding (stored before it is returned). `None` when shutdown
/// came first.
async fn ensure_identity(
    config: &Config,
    store: &IdentityStore,
    onboard_url: &str,
    relay_tls: &Arc<rustls::ClientConfig>,
    proxy: Option<&ProxyConfig>,
    reconnect: &mut Reconnect,
    shutdown: &mut Shutdown,
) -> Result<Option<Identity>, AgentError> {
    // An expired identity is worth nothing when a new onboarding token is at hand: the recovery the relay tells
    // the user about (delete the cluster, connect it again, start the agent with the new token) needs no
    // hand-emptied store. Without a token it is used anyway, and the relay says what to do.
    let usable = |stored: &Identity| {
        let expired = stored.is_expired(OffsetDateTime::now_utc());
        if expired && config.onboarding_secret().is_some() {
            tracing::warn!(
                "the stored identity has expired; onboarding again with the given onboarding token"
            );
        } else if expired {
            tracing::warn!("the stored identity has expired; the relay will refuse it");
        }
        !expired || config.onboarding_secret().is_none()
    };
    let found = match store {
        IdentityStore::Dir(dir) => {
            identity::load(dir, &config.relay_url, &config.cluster)?.filter(|stored| usable(stored))
        }
        IdentityStore::Secret(secret) => {
            match acquire_from_secret(config, secret, &usable, reconnect, shutdown).await? {
                Some(Acquired::Identity(stored)) => Some(stored),
                Some(_) => None,
                None => return Ok(None),
            }
        }
    };
    if let Some(stored) = found {
        tracing::info!(
            store = %store.describe(),
            fingerprint = %stored.fingerprint,
            not_after = %stored.not_after,
            "using the stored identity"
        );
        return Ok(Some(stored));
    }
    let Some(token) = config.onboarding_secret() else {
        return Err(ConfigError::MissingOnboardingToken {
            relay: config.relay_url.clone(),
            cluster: config.cluster.clone(),
            state_dir: store.describe(),
        }
        .into());
    };
    // One key for all attempts: the CSR stays valid, and the key never leaves this process until stored.
    let request = identity::new_key_request(&config.cluster)?;
    let mut last_failure: Option<String> = None;
    loop {
        if let IdentityStore::Secret(secret) = store
            && let Err(e) = secret.refresh_claim().await
        {
            tracing::warn!(error = %e, "cannot refresh the onboarding claim");
        }
        let onboarding = Onboarding {
            url: onboard_url,
            tls: relay_tls,
            proxy,
            cluster: &config.cluster,
            token,
            csr: &request.csr,
            timeout: config.connect_timeout,
        };
        let result = tokio::select! {
            result = onboarding.run() => result,
            () = shutdown.as_mut() => return Ok(None),
        };
        let delay = match result {
            Ok(issued) => {
                let identity = Identity::new(
                    &config.relay_url,
                    &config.cluster,
                    &issued.certificate,
                    request.key.clone(),
                    OffsetDateTime::now_utc(),
                )?;
                match store {
                    IdentityStore::Dir(dir) => identity::store(dir, &identity)?,
                    IdentityStore::Secret(secret) => secret.store(&identity).await?,
                }
                tracing::info!(
                    store = %store.describe(),
                    fingerprint = %identity.fingerprint,
                    not_after = %identity.not_after,
                    "onboarded; identity stored"
                );
                return Ok(Some(identity));
            }
            Err(OnboardError::Refused { status, message }) => {
                return Err(AgentError::OnboardingRefused { status, message });
            }
            Err(e @ OnboardError::Transient { .. }) => {
                let error = e.to_string();
                let delay = reconnect.next_delay();
                if last_failure.as_deref() == Some(error.as_str()) {
                    tracing::debug!(%error, retry_in = ?delay, "onboarding failed");
                } else {
                    tracing::warn!(%error, retry_in = ?delay, "onboarding failed");
                    last_failure = Some(error);
                }
                delay
            }
        };
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = shutdown.as_mut() => return Ok(None),
        }
    }
}

fn tunnel_headers(cluster: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    if let Ok(value) = HeaderValue::try_from(cluster) {
        headers.insert("tether-cluster", value);
    }
    headers.insert(
        "tether-agent-version",
        HeaderValue::from_static(env!("CARGO_PKG_VERSION")),
    );
    headers
}

async fn load_kube_config(path: Option<&Path>) -> Result<kube::Config, AgentError> {
    let boxed = |e: Box<dyn std::error::Error + Send + Sync>| AgentError::KubeConfig(e);
    match path {
        Some(path) => {
            let kubeconfig =
                kube::config::Kubeconfig::read_from(path).map_err(|e| boxed(Box::new(e)))?;
            kube::Config::from_custom_kubeconfig(
                kubeconfig,
                &kube::config::KubeConfigOptions::default(),
            )
            .await
            .map_err(|e| boxed(Box::new(e)))
        }
        None => kube::Config::infer().await.map_err(|e| boxed(Box::new(e))),
    }
}

enum Ended {
    Shutdown,
    Disconnected(String),
}

/// Serves one tunnel until it ends, its control channel ends, or shutdown is asked for (then GOAWAY, drain,
/// close).
async fn serve(
    conn: Connection,
    upstream: &Upstream,
    probes: &Probes,
    streams: &mut JoinSet<()>,
    shutdown: &mut Shutdown,
    drain_timeout: Duration,
    state: &mut control::State,
) -> Ended {
    let control = control::run(&conn, state);
    tokio::pin!(control);
    let shutting_down = loop {
        tokio::select! {
            incoming = conn.accept() => match incoming {
                Some(incoming) => handle_incoming(incoming, &conn, upstream, probes, streams),
                None => {
                    // GOAWAY. A relay that is going away says on the control channel when to come back
                    // (`draining`), right after; give that message a moment to arrive.
                    let _ = tokio::time::timeout(DRAINING_WAIT, &mut control).await;
                    break false;
                }
            },
            // Reap finished streams so the set does not grow.
            Some(_) = streams.join_next(), if !streams.is_empty() => {}
            reason = &mut control => {
                if !conn.is_closed() {
                    conn.close(code::NO_ERROR, "control channel ended");
                    return Ended::Disconnected(format!("control channel ended: {reason}"));
                }
                break false;
            }
            () = shutdown.as_mut() => break true,
        }
    };
    if !shutting_down {
        // Streams already accepted keep running on the old tunnel while it lasts.
        let reason = if conn.is_closed() {
            match conn.closed().await.error {
                Some(error) => error.to_string(),
                None => "the relay closed the tunnel".to_string(),
            }
        } else {
            "the relay is going away".to_string()
        };
        return Ended::Disconnected(reason);
    }

    tracing::info!(open_streams = streams.len(), drain_timeout = ?drain_timeout, "shutting down: draining streams");
    conn.go_away(code::SHUTDOWN, "agent shutting down");
    drain(streams, drain_timeout).await;
    conn.close(code::NO_ERROR, "agent shut down");
    Ended::Shutdown
}

/// Waits up to `drain_timeout` for the streams to finish, then cuts the rest.
async fn drain(streams: &mut JoinSet<()>, drain_timeout: Duration) {
    if streams.is_empty() {
        return;
    }
    let drained = tokio::time::timeout(drain_timeout, async {
        while streams.join_next().await.is_some() {}
    });
    if drained.await.is_err() {
        tracing::warn!(
            open_streams = streams.len(),
            "drain timeout reached; cutting the remaining streams"
        );
        streams.shutdown().await;
    } else {
        tracing::info!("all streams finished");
    }
}

fn handle_incoming(
    incoming: Incoming,
    conn: &Connection,
    upstream: &Upstream,
    probes: &Probes,
    streams: &mut JoinSet<()>,
) {
    if incoming.kind != kind::HTTP {
        tracing::debug!(
            kind = incoming.kind,
            "refusing a stream of unsupported kind"
        );
        incoming.refuse(
            code::UNSUPPORTED_KIND,
            "this agent serves only HTTP streams",
        );
        return;
    }
    let stream = match incoming.accept(Bytes::new()) {
        Ok(stream) => stream,
        Err(e) => {
            tracing::debug!(error = %e, "cannot accept a stream");
            return;
        }
    };
    let upstream = upstream.clone();
    let conn = conn.clone();
    let control = stream.control();
    let counted = probes.stream_opened();
    streams.spawn(async move {
        let _counted = counted;
        let id = stream.id();
        // A stream whose tunnel is gone ends with it: otherwise a response waiting on the apiserver (a quiet
        // watch, `logs -f`) would hold its upstream connection until the apiserver next sends something.
        // Likewise a stream the relay reset (its user left, or its request deadline passed): cancelling the
        // task drops the upstream request, so one still waiting for an upstream connection or stream is
        // never sent, and one in flight is cancelled.
        tokio::select! {
            result = serve_stream(stream, upstream) => {
                if let Err(e) = result {
                    tracing::debug!(stream = ?id, error = %e, "stream ended with an error");
                }
            }
            _ = conn.closed() => {
                tracing::debug!(stream = ?id, "tunnel closed; stream cut");
            }
            why = control.failed() => {
                tracing::debug!(stream = ?id, error = %why, "stream reset; request cut");
            }
        }
    });
}

//! The agent's life: onboard once, dial the relay, serve streams, reconnect with backoff, drain on shutdown.

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use tether_tunnel::ws::{self, ConnectError};
use tether_tunnel::{Connection, Incoming, Role, Secret, SessionConfig, code, kind, tls};
use tokio::task::JoinSet;

use crate::backoff::Reconnect;
use crate::config::{Config, ConfigError};
use crate::credential::{self, Credential, CredentialError};
use crate::forward::{Upstream, UpstreamError, serve_stream};
use crate::onboard::{OnboardError, onboard};

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
    /// The relay CA could not be loaded.
    #[error("cannot load the relay CA: {0}")]
    RelayTls(#[from] tls::TlsError),
    /// The credential file could not be read or written.
    #[error(transparent)]
    Credential(#[from] CredentialError),
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
    /// The relay rejected the stored credential: the cluster was deleted or its credential revoked.
    #[error(
        "the relay rejected this cluster's credential (HTTP {status}): it was deleted or revoked; register it again"
    )]
    CredentialRejected {
        /// HTTP status (401 or 403).
        status: StatusCode,
    },
}

/// Runs the agent until `shutdown` resolves (then drains and returns `Ok`) or a fatal error.
pub async fn run(
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), AgentError> {
    config.validate()?;
    tls::install_crypto_provider();
    let tunnel_url = config.tunnel_url()?;
    let onboard_url = config.onboard_url()?;

    let kube_config = load_kube_config(config.kubeconfig.as_deref()).await?;
    let upstream = Upstream::from_kube_config(&kube_config)?;
    // The agent's own identity, kept apart from forwarding (which carries only the users' credentials).
    let _agent_client = kube::Client::try_from(kube_config).map_err(AgentError::KubeClient)?;

    let ca_pem = config.relay_ca.as_deref().map(tls::read_file).transpose()?;
    let relay_tls = tls::client_config(ca_pem.as_deref(), &[b"http/1.1"])?;

    tracing::info!(relay = %config.relay_url, cluster = %config.cluster, apiserver = %upstream.base(), "agent starting");
    let mut shutdown: Pin<Box<dyn Future<Output = ()> + Send>> = Box::pin(shutdown);
    let mut reconnect = Reconnect::new(config.backoff);

    let Some(credential) = ensure_credential(
        &config,
        &onboard_url,
        &relay_tls,
        &mut reconnect,
        &mut shutdown,
    )
    .await?
    else {
        tracing::info!("shut down before onboarding finished");
        return Ok(());
    };
    let headers = tunnel_headers(&config.cluster, &credential);

    // Every stream task, across tunnels: a stream of a tunnel the relay is retiring still drains on shutdown.
    let mut streams = JoinSet::new();
    let mut last_failure: Option<String> = None;
    loop {
        if last_failure.is_none() {
            tracing::info!(url = %tunnel_url, "connecting to the relay");
        }
        let session = SessionConfig::new(Role::Client);
        let connecting = tokio::time::timeout(
            config.connect_timeout,
            ws::connect(&tunnel_url, relay_tls.clone(), headers.clone(), session),
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
                tracing::info!("connected to the relay");
                last_failure = None;
                reconnect.connected();
                match serve(
                    conn,
                    &upstream,
                    &mut streams,
                    &mut shutdown,
                    config.drain_timeout,
                )
                .await
                {
                    Ended::Shutdown => return Ok(()),
                    Ended::Disconnected(reason) => {
                        let delay = reconnect.next_delay();
                        tracing::warn!(%reason, retry_in = ?delay, "disconnected from the relay");
                        delay
                    }
                }
            }
            Ok(Err(ConnectError::Rejected { status, .. }))
                if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN =>
            {
                let error = AgentError::CredentialRejected { status };
                tracing::error!(%error, "giving up");
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

/// The stored credential, or a new one from onboarding (stored before it is returned). `None` when shutdown
/// came first.
async fn ensure_credential(
    config: &Config,
    onboard_url: &str,
    relay_tls: &Arc<rustls::ClientConfig>,
    reconnect: &mut Reconnect,
    shutdown: &mut Pin<Box<dyn Future<Output = ()> + Send>>,
) -> Result<Option<Secret>, AgentError> {
    if let Some(stored) = credential::load(&config.state_dir, &config.relay_url, &config.cluster)? {
        tracing::info!(state_dir = %config.state_dir.display(), "using the stored credential");
        return Ok(Some(stored.credential));
    }
    let Some(token) = &config.onboarding_token else {
        return Err(ConfigError::MissingOnboardingToken {
            relay: config.relay_url.clone(),
            cluster: config.cluster.clone(),
            state_dir: config.state_dir.display().to_string(),
        }
        .into());
    };
    let mut last_failure: Option<String> = None;
    loop {
        let attempt = onboard(
            onboard_url,
            relay_tls,
            &config.cluster,
            token,
            config.connect_timeout,
        );
        let result = tokio::select! {
            result = attempt => result,
            () = shutdown.as_mut() => return Ok(None),
        };
        let delay = match result {
            Ok(credential) => {
                let stored = Credential {
                    relay: config.relay_url.clone(),
                    cluster: config.cluster.clone(),
                    credential: credential.clone(),
                };
                credential::store(&config.state_dir, &stored)?;
                tracing::info!(state_dir = %config.state_dir.display(), "onboarded; credential stored");
                return Ok(Some(credential));
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

fn tunnel_headers(cluster: &str, credential: &Secret) -> HeaderMap {
    let mut headers = HeaderMap::new();
    if let Ok(mut value) = HeaderValue::try_from(format!("Bearer {}", credential.expose())) {
        value.set_sensitive(true);
        headers.insert(http::header::AUTHORIZATION, value);
    }
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

/// Serves one tunnel until it ends or shutdown is asked for (then GOAWAY, drain, close).
async fn serve(
    conn: Connection,
    upstream: &Upstream,
    streams: &mut JoinSet<()>,
    shutdown: &mut Pin<Box<dyn Future<Output = ()> + Send>>,
    drain_timeout: Duration,
) -> Ended {
    let shutting_down = loop {
        tokio::select! {
            incoming = conn.accept() => match incoming {
                Some(incoming) => handle_incoming(incoming, upstream, streams),
                None => break false,
            },
            // Reap finished streams so the set does not grow.
            Some(_) = streams.join_next(), if !streams.is_empty() => {}
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

fn handle_incoming(incoming: Incoming, upstream: &Upstream, streams: &mut JoinSet<()>) {
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
    streams.spawn(async move {
        let id = stream.id();
        if let Err(e) = serve_stream(stream, upstream).await {
            tracing::debug!(stream = ?id, error = %e, "stream ended with an error");
        }
    });
}

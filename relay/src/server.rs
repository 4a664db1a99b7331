//! The HTTPS listener: TLS, HTTP/1.1 and HTTP/2, limits, graceful shutdown, and routing.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use rustls::pki_types::CertificateDer;
use serde::de::DeserializeOwned;
use tether_tunnel::code;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::activity::ActivityLog;
use crate::body::{self, Body};
use crate::config::Config;
use crate::error::{ApiError, RelayError};
use crate::identity::AgentCa;
use crate::rbac::GuardHub;
use crate::registry::Registry;
use crate::store::{Store, TokenHash};
use crate::{agent, api, rbac, user};

/// State shared by every connection and tunnel task.
pub(crate) struct Shared {
    pub(crate) config: Config,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) registry: Registry,
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
    shutting_down: AtomicBool,
    /// Set on shutdown: the window, in milliseconds, within which agents are told to come back (0: none).
    reconnect_window_ms: AtomicU64,
}

impl Shared {
    pub(crate) fn new(
        config: Config,
        store: Arc<dyn Store>,
        admin_token_hash: TokenHash,
        agent_ca: AgentCa,
        entra: Option<Arc<tether_auth::Authenticator>>,
    ) -> Self {
        Self {
            config,
            store,
            registry: Registry::default(),
            admin_token_hash,
            agent_ca,
            activity: ActivityLog::default(),
            tasks: TaskTracker::new(),
            guard: GuardHub::default(),
            entra,
            shutting_down: AtomicBool::new(false),
            reconnect_window_ms: AtomicU64::new(0),
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
}

/// What a request handler knows about its connection.
#[derive(Clone)]
pub(crate) struct ConnCtx {
    /// Held for as long as anything uses the connection, upgraded byte pipes and tunnels included, so
    /// `max_connections` counts them too.
    pub(crate) permit: Arc<OwnedSemaphorePermit>,
    pub(crate) peer: SocketAddr,
    /// The client certificate the peer presented, already verified against the agent CA (expiry aside). Only
    /// the tunnel endpoint looks at it.
    pub(crate) client_cert: Option<Arc<CertificateDer<'static>>>,
}

/// The window within which `tunnels` agents should come back to a relay accepting `rate` tunnels per second:
/// `tunnels / rate` seconds, at least one second.
fn reconnect_window(tunnels: usize, rate: u32) -> Duration {
    let ms = (tunnels as u64).saturating_mul(1000) / u64::from(rate.max(1));
    Duration::from_millis(ms.max(1000))
}

/// Accepts connections until `shutdown` resolves, then shuts down gracefully.
pub(crate) async fn serve(
    shared: Arc<Shared>,
    tls: Arc<rustls::ServerConfig>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RelayError> {
    let acceptor = TlsAcceptor::from(tls);
    let limits = shared.config.limits.clone();
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = CancellationToken::new();
    let hard = CancellationToken::new();
    let connections = TaskTracker::new();
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "relay listening");
    }
    let stop_flusher = CancellationToken::new();
    let flusher = tokio::spawn(flush_activity(shared.clone(), stop_flusher.clone()));
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            () = &mut shutdown => break,
            permit = slots.clone().acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        let (tcp, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) if is_transient_accept_error(&e) => {
                    // Typically out of file descriptors: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed; retrying");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
                Err(e) => return Err(RelayError::Accept(e)),
            },
        };
        let _ = tcp.set_nodelay(true);
        connections.spawn(serve_connection(
            shared.clone(),
            acceptor.clone(),
            tcp,
            ConnCtx {
                permit: Arc::new(permit),
                peer,
                client_cert: None,
            },
            graceful.clone(),
            hard.clone(),
        ));
    }
    drop(listener);
    tracing::info!("relay shutting down");

    shared.shutting_down.store(true, Ordering::Release);
    let tunnels = shared.registry.all();
    let window = reconnect_window(tunnels.len(), limits.reconnect_rate);
    tracing::info!(tunnels = tunnels.len(), reconnect_within = ?window, "telling agents to reconnect");
    shared.reconnect_window_ms.store(
        u64::try_from(window.as_millis()).unwrap_or(u64::MAX),
        Ordering::Release,
    );
    for tunnel in tunnels {
        tunnel.go_away(code::SHUTDOWN, "relay shutting down");
    }
    graceful.cancel();
    connections.close();
    shared.tasks.close();
    let grace = limits.shutdown_grace;
    let drained = tokio::time::timeout(grace, async {
        connections.wait().await;
        shared.tasks.wait().await;
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            ?grace,
            "requests or tunnels still open after the shutdown grace period; closing them"
        );
        for tunnel in shared.registry.all() {
            tunnel
                .conn
                .close(code::CANCEL, "relay shutting down: grace period over");
        }
        hard.cancel();
        let cut = tokio::time::timeout(grace, async {
            connections.wait().await;
            shared.tasks.wait().await;
        })
        .await;
        if cut.is_err() {
            tracing::warn!("some tasks did not stop after being cut; leaving them");
        }
    }
    stop_flusher.cancel();
    if flusher.await.is_err() {
        tracing::warn!("the activity writer panicked");
    }
    if let Err(e) = shared.store.close().await {
        tracing::warn!(error = %e, "closing the store failed");
    }
    tracing::info!("relay stopped");
    Ok(())
}

/// Writes batched heartbeats every `last_seen_interval`, and once more when stopped.
async fn flush_activity(shared: Arc<Shared>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(shared.config.limits.last_seen_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let stopping = tokio::select! {
            () = stop.cancelled() => true,
            _ = tick.tick() => false,
        };
        if let Err(e) = shared.activity.flush(shared.store.as_ref()).await {
            tracing::warn!(error = %e, "cannot write heartbeats to the store; will retry");
        }
        if stopping {
            return;
        }
    }
}

fn is_transient_accept_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionAborted | ConnectionReset | Interrupted | WouldBlock | OutOfMemory
    ) || matches!(e.raw_os_error(), Some(23 | 24)) // ENFILE, EMFILE
}

async fn serve_connection(
    shared: Arc<Shared>,
    acceptor: TlsAcceptor,
    tcp: TcpStream,
    mut ctx: ConnCtx,
    graceful: CancellationToken,
    hard: CancellationToken,
) {
    let limits = &shared.config.limits;
    let tls = tokio::select! {
        () = graceful.cancelled() => return,
        r = tokio::time::timeout(limits.tls_handshake_timeout, acceptor.accept(tcp)) => match r {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => {
                tracing::debug!(peer = %ctx.peer, error = %e, "TLS handshake failed");
                return;
            }
            Err(_) => {
                tracing::debug!(peer = %ctx.peer, "TLS handshake timed out");
                return;
            }
        },
    };
    ctx.client_cert = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|chain| chain.first())
        .map(|cert| Arc::new(cert.clone().into_owned()));

    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(limits.max_header_bytes);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.h2_max_concurrent_streams)
        .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX))
        .keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(20));

    let svc_shared = shared.clone();
    let svc_ctx = ctx.clone();
    let svc = service_fn(move |req: Request<Incoming>| {
        let shared = svc_shared.clone();
        let ctx = svc_ctx.clone();
        async move { Ok::<_, Infallible>(route(shared, ctx, req).await) }
    });
    let conn = builder.serve_connection_with_upgrades(TokioIo::new(tls), svc);
    tokio::pin!(conn);
    let result = tokio::select! {
        r = conn.as_mut() => r,
        () = graceful.cancelled() => {
            conn.as_mut().graceful_shutdown();
            tokio::select! {
                r = conn.as_mut() => r,
                () = hard.cancelled() => return,
            }
        }
        () = hard.cancelled() => return,
    };
    if let Err(e) = result {
        tracing::debug!(peer = %ctx.peer, error = %e, "connection ended with an error");
    }
}

/// Dispatches a request; every error becomes a `Status` response here.
async fn route(shared: Arc<Shared>, ctx: ConnCtx, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_owned();
    let result = if path == "/healthz" {
        Ok(text(StatusCode::OK, "ok"))
    } else if let Some(rest) = path.strip_prefix("/clusters/") {
        user::handle(&shared, ctx, req, rest).await
    } else if path == "/agent/v1/onboard" {
        if req.method() == Method::POST {
            agent::onboard(&shared, req).await
        } else {
            Err(ApiError::method_not_allowed())
        }
    } else if path == "/agent/v1/tunnel" {
        if req.method() == Method::GET {
            agent::tunnel(&shared, ctx, req).await
        } else {
            Err(ApiError::method_not_allowed())
        }
    } else if path == "/api/v1/clusters" {
        api::handle(&shared, req, None).await
    } else if let Some(name) = path.strip_prefix("/api/v1/clusters/") {
        let name = name.to_owned();
        api::handle(&shared, req, Some(&name)).await
    } else if let Some(rest) = collection(&path, "/api/v1/roledefinitions") {
        rbac::role_definitions(&shared, req, rest.as_deref()).await
    } else if let Some(rest) = collection(&path, "/api/v1/roleassignments") {
        rbac::role_assignments(&shared, req, rest.as_deref()).await
    } else if let Some(rest) = collection(&path, "/api/v1/denyassignments") {
        rbac::deny_assignments(&shared, req, rest.as_deref()).await
    } else if let Some(oid) = path.strip_prefix("/api/v1/directory/users/") {
        let oid = oid.to_owned();
        rbac::directory(&shared, req, &oid).await
    } else {
        Err(ApiError::not_found(format!("the relay serves no {path}")))
    };
    result.unwrap_or_else(ApiError::into_response)
}

/// `Some(None)` for `path == base`, `Some(Some(rest))` for `base/rest`, `None` otherwise.
fn collection(path: &str, base: &str) -> Option<Option<String>> {
    let rest = path.strip_prefix(base)?;
    if rest.is_empty() {
        Some(None)
    } else {
        rest.strip_prefix('/').map(|r| Some(r.to_owned()))
    }
}

pub(crate) fn text(status: StatusCode, s: &'static str) -> Response<Body> {
    let mut resp = Response::new(body::full(s));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

pub(crate) fn json(status: StatusCode, value: &serde_json::Value) -> Response<Body> {
    let mut resp = Response::new(body::full(value.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    resp
}

/// Reads a body of at most `max_control_body_bytes`.
pub(crate) async fn read_body(shared: &Shared, body: Incoming) -> Result<bytes::Bytes, ApiError> {
    let limit = shared.config.limits.max_control_body_bytes;
    let bytes = Limited::new(body, limit).collect().await.map_err(|e| {
        if e.is::<http_body_util::LengthLimitError>() {
            ApiError::too_large(limit)
        } else {
            ApiError::bad_request(format!("cannot read the request body: {e}"))
        }
    })?;
    Ok(bytes.to_bytes())
}

/// Reads a JSON body of at most `max_control_body_bytes`.
pub(crate) async fn read_json<T: DeserializeOwned>(
    shared: &Shared,
    body: Incoming,
) -> Result<T, ApiError> {
    let bytes = read_body(shared, body).await?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reconnect_window_is_tunnels_over_rate_and_at_least_a_second() {
        assert_eq!(reconnect_window(10_000, 1_000), Duration::from_secs(10));
        assert_eq!(reconnect_window(2_500, 1_000), Duration::from_millis(2_500));
        assert_eq!(reconnect_window(3, 1_000), Duration::from_secs(1));
        assert_eq!(reconnect_window(0, 1_000), Duration::from_secs(1));
        assert_eq!(
            reconnect_window(usize::MAX, 1),
            Duration::from_millis(u64::MAX)
        );
    }
}

//! The HTTPS server: TLS accept loop, one hyper connection (HTTP/1.1 or h2) per client, connection limits, and
//! the per-request front door (count, authenticate, authorize, log) before [`crate::handlers`] route the request.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::auth::Authenticator;
use crate::authz::Authorizer;
use crate::body::Body;
use crate::store::Store;

/// Largest request body accepted (413 beyond).
pub(crate) const MAX_BODY: usize = 3 * 1024 * 1024;
/// Largest request head (HTTP/1.1 read buffer, h2 header list).
const MAX_HEADER_BYTES: usize = 64 * 1024;
/// How long a client has to finish the TLS handshake.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a client has to send a request head once it started one (and how long an idle keep-alive lasts).
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a client has to send a request body.
pub(crate) const BODY_READ_TIMEOUT: Duration = Duration::from_secs(60);

/// State shared by every connection and request.
pub(crate) struct Shared {
    pub(crate) store: Store,
    pub(crate) authn: Authenticator,
    pub(crate) authz: Authorizer,
    pub(crate) requests: AtomicU64,
    /// Requests refused for a missing or unknown bearer token.
    pub(crate) unauthenticated: AtomicU64,
    /// Requests per User-Agent product (the part before the first `/`), bounded.
    pub(crate) user_agents: std::sync::Mutex<std::collections::HashMap<String, u64>>,
    /// The listen address, for discovery's `serverAddressByClientCIDRs`.
    pub(crate) addr: SocketAddr,
    /// When the server started: the demo pod's log ticks count from here.
    pub(crate) started: Instant,
    pub(crate) started_wall: time::OffsetDateTime,
    /// The uid of the seeded `default/demo` pod, whose log ticks every second.
    pub(crate) demo_uid: String,
    /// The loopback servers that answer for pod ports (port-forward).
    pub(crate) pod_network: crate::portforward::PodNetwork,
    /// Where each pod's scratch filesystem lives (`DIR/pods`), for `kubectl cp`.
    pub(crate) pods_dir: std::path::PathBuf,
    /// Cancelled on shutdown: every connection, watch, log stream and exec session ends.
    pub(crate) shutdown: CancellationToken,
    /// Tracks every background task (connections, exec sessions, streams) so shutdown can wait for them.
    pub(crate) tracker: TaskTracker,
}

impl Shared {
    /// A store seeded with the namespaces `default`, `kube-system`, `kube-public`, the node and the demo pod.
    pub(crate) fn new(
        addr: SocketAddr,
        shutdown: CancellationToken,
        tracker: TaskTracker,
        authn: Authenticator,
        authz: Authorizer,
        pod_network: crate::portforward::PodNetwork,
        pods_dir: std::path::PathBuf,
    ) -> Shared {
        let store = Store::new();
        for ns in ["default", "kube-system", "kube-public"] {
            let obj = serde_json::json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}});
            if let Err(e) =
                crate::objects::create_object(&store, crate::resources::Resource::Namespaces, obj)
            {
                tracing::error!(ns, error = %e.message, "cannot seed namespace");
            }
        }
        let seeded = [
            (
                crate::resources::Resource::Nodes,
                crate::resources::sample_node(),
            ),
            (
                crate::resources::Resource::Pods,
                crate::resources::demo_pod(),
            ),
            (
                crate::resources::Resource::Services,
                crate::resources::kubernetes_service(),
            ),
            (
                crate::resources::Resource::Services,
                crate::resources::demo_service(),
            ),
            (
                crate::resources::Resource::Secrets,
                crate::resources::demo_secret(),
            ),
        ];
        let mut demo_uid = String::new();
        for (resource, obj) in seeded {
            match crate::objects::create_object(&store, resource, obj) {
                Ok(created) if resource == crate::resources::Resource::Pods => {
                    demo_uid = created["metadata"]["uid"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string();
                }
                Ok(_) => {}
                Err(e) => tracing::error!(error = %e.message, "cannot seed object"),
            }
        }
        Shared {
            store,
            authn,
            authz,
            requests: AtomicU64::new(0),
            unauthenticated: AtomicU64::new(0),
            user_agents: std::sync::Mutex::new(std::collections::HashMap::new()),
            addr,
            started: Instant::now(),
            started_wall: time::OffsetDateTime::now_utc(),
            demo_uid,
            pod_network,
            pods_dir,
            shutdown,
            tracker,
        }
    }
}

/// Accepts TCP connections until shutdown; each one is served in its own tracked task.
pub(crate) async fn accept_loop(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    shared: Arc<Shared>,
    max_streams: u32,
) {
    loop {
        let accepted = tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((tcp, peer)) => {
                let _ = tcp.set_nodelay(true);
                shared.tracker.spawn(serve_connection(
                    tcp,
                    peer,
                    acceptor.clone(),
                    shared.clone(),
                    max_streams,
                ));
            }
            Err(error) => {
                // Out of file descriptors and the like: back off briefly instead of spinning.
                tracing::warn!(%error, "accept failed");
                tokio::select! {
                    _ = shared.shutdown.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                }
            }
        }
    }
}

async fn serve_connection(
    tcp: tokio::net::TcpStream,
    peer: SocketAddr,
    acceptor: TlsAcceptor,
    shared: Arc<Shared>,
    max_streams: u32,
) {
    let tls = match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(error)) => {
            tracing::debug!(%peer, %error, "TLS handshake failed");
            return;
        }
        Err(_) => {
            tracing::debug!(%peer, "TLS handshake timed out");
            return;
        }
    };
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_buf_size(MAX_HEADER_BYTES);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(MAX_HEADER_BYTES as u32)
        .max_concurrent_streams(max_streams)
        .keep_alive_interval(Duration::from_secs(30));
    let service_shared = shared.clone();
    let service = hyper::service::service_fn(move |req| {
        let shared = service_shared.clone();
        async move { Ok::<_, Infallible>(handle(shared, peer, req).await) }
    });
    let conn = builder.serve_connection_with_upgrades(TokioIo::new(tls), service);
    tokio::select! {
        result = conn => {
            if let Err(error) = result {
                tracing::debug!(%peer, %error, "connection ended with an error");
            }
        }
        _ = shared.shutdown.cancelled() => {}
    }
}

/// Most distinct User-Agent products counted.
const MAX_USER_AGENTS: usize = 256;

/// Every request: count it, authenticate, apply impersonation, route (which authorizes), log.
async fn handle(shared: Arc<Shared>, peer: SocketAddr, req: Request<Incoming>) -> Response<Body> {
    shared.requests.fetch_add(1, Ordering::Relaxed);
    count_user_agent(&shared, req.headers());
    let started = Instant::now();
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let version = req.version();
    let response = match shared.authn.authenticate(req.headers()).await {
        Ok(user) => match crate::authz::impersonate(&shared.authz, user, req.headers()).await {
            Ok(user) => crate::handlers::route(&shared, user, req).await,
            Err(e) => crate::handlers::error_response(&e),
        },
        Err(e) => {
            shared.unauthenticated.fetch_add(1, Ordering::Relaxed);
            crate::handlers::error_response(&e)
        }
    };
    tracing::debug!(
        %peer, %method, path, ?version, status = response.status().as_u16(),
        elapsed_ms = started.elapsed().as_millis() as u64, "request"
    );
    response
}

fn count_user_agent(shared: &Shared, headers: &http::HeaderMap) {
    let product = headers
        .get(http::header::USER_AGENT)
        .and_then(|v| v.to_str().ok())
        .map(|ua| ua.split('/').next().unwrap_or_default().trim().to_string())
        .unwrap_or_default();
    if let Ok(mut agents) = shared.user_agents.lock()
        && (agents.len() < MAX_USER_AGENTS || agents.contains_key(&product))
    {
        *agents.entry(product).or_default() += 1;
    }
}

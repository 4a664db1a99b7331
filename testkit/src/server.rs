//! The listener: [`tether_runtime::serve`] (TLS, HTTP/1.1 or h2 per client, upgrades) with kube-apiserver's
//! per-connection stream limit, and the per-request front door (count, authenticate, impersonate, log) before the
//! router ([`crate::handlers`]).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use http::{Request, Response};
use hyper::body::Incoming;
use tether_runtime::serve;
use tokio::net::TcpListener;

use crate::body::Body;
use crate::state::Shared;

/// Serves connections until shutdown, then drops every one still open (the sample apiserver does not drain).
pub(crate) async fn accept_loop(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    shared: Arc<Shared>,
    max_streams: u32,
) {
    let limits = serve::Limits {
        // No connection limit, as before: tests open as many as they need.
        max_connections: usize::MAX,
        tls_handshake_timeout: Duration::from_secs(10),
        header_read_timeout: Duration::from_secs(30),
        max_header_bytes: 64 * 1024,
        h2_max_concurrent_streams: max_streams,
        h2_keep_alive_interval: Some(Duration::from_secs(30)),
        ..serve::Limits::default()
    };
    let service_shared = shared.clone();
    let make_service = move |conn: serve::Conn| {
        let shared = service_shared.clone();
        let peer = conn.peer;
        hyper::service::service_fn(move |req| {
            let shared = shared.clone();
            async move { Ok::<_, Infallible>(handle(shared, peer, req).await) }
        })
    };
    let shutdown = shared.shutdown.clone().cancelled_owned();
    let draining = serve::serve(listener, tls, limits, make_service, shutdown).await;
    draining.cut();
    draining.wait().await;
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
            Err(e) => crate::respond::error_response(&e),
        },
        Err(e) => {
            shared.unauthenticated.fetch_add(1, Ordering::Relaxed);
            crate::respond::error_response(&e)
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

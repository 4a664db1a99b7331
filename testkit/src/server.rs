//! The listener: TLS accept loop, one hyper connection (HTTP/1.1 or h2) per client, connection limits, and the
//! per-request front door (count, authenticate, impersonate, log) before the router ([`crate::handlers`]).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use crate::body::Body;
use crate::state::Shared;

/// Largest request head (HTTP/1.1 read buffer, h2 header list).
const MAX_HEADER_BYTES: usize = 64 * 1024;
/// How long a client has to finish the TLS handshake.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a client has to send a request head once it started one (and how long an idle keep-alive lasts).
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

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

//! The peer link's listener (`--peer-listen`): [`tether_runtime::serve`] with the peer TLS (a client
//! certificate of a replica of this fleet required: [`crate::peer_tls`]), bounded like the user listener
//! (connections, handshakes, header sizes and read time, idle time), requests to
//! [`crate::router::route_peer`]. It runs beside the HTTPS listener and stops with it.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::Request;
use hyper::body::Incoming;
use hyper::service::service_fn;
use tether_runtime::serve;
use tokio::net::TcpListener;

use crate::config::{Config, Limits};
use crate::error::RelayError;
use crate::router;
use crate::state::{ConnCtx, Shared};

/// HTTP/2 streams per peer connection: a replica multiplexes every request it forwards to this one (watches
/// included) over one connection, so this must fit the watches one replica holds for the tunnels of another.
pub(crate) const PEER_H2_STREAMS: u32 = 16_384;

/// Binds `--peer-listen`, if set.
pub(crate) async fn bind(config: &Config) -> Result<Option<TcpListener>, RelayError> {
    let Some(addr) = config.peer_listen else {
        return Ok(None);
    };
    TcpListener::bind(addr)
        .await
        .map(Some)
        .map_err(|source| RelayError::Io {
            what: "cannot listen for peers on",
            path: addr.to_string(),
            source,
        })
}

/// The address peers reach this replica at: `--peer-address`, else the bound peer listener's address when it
/// names a specific one (`--peer-listen 127.0.0.1:0` in tests gets its port here).
pub(crate) fn advertised(config: &Config, bound: Option<SocketAddr>) -> Option<String> {
    match (&config.peer_address, bound) {
        (Some(address), _) => Some(address.clone()),
        (None, Some(addr)) if !addr.ip().is_unspecified() => Some(addr.to_string()),
        _ => None,
    }
}

/// The peer listener's limits, from the relay's.
fn serve_limits(limits: &Limits) -> serve::Limits {
    serve::Limits {
        max_connections: limits.max_connections,
        cert_budget: None,
        max_handshakes: limits.max_handshakes,
        max_handshakes_per_ip: limits.max_handshakes_per_ip,
        // Every upgraded session forwarded by one replica is a connection from its address.
        max_connections_per_ip: limits.max_connections,
        tls_handshake_timeout: limits.tls_handshake_timeout,
        header_read_timeout: limits.header_read_timeout,
        idle_timeout: Some(limits.user_idle_timeout),
        max_header_bytes: limits.max_header_bytes,
        h2_max_concurrent_streams: PEER_H2_STREAMS,
        h2_keep_alive_interval: Some(Duration::from_secs(30)),
        h2_keep_alive_timeout: Duration::from_secs(20),
    }
}

/// Serves peers on `listener` until `stop` resolves; returns the connections still open, to drain.
pub(crate) async fn serve(
    shared: Arc<Shared>,
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    stop: impl Future<Output = ()>,
) -> serve::Draining {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, replica = %shared.fleet.replica_id, "relay listening for peers");
    }
    let limits = serve_limits(&shared.config.limits);
    let make_service = move |conn: serve::Conn| {
        let ctx = ConnCtx::new(conn);
        let shared = shared.clone();
        service_fn(move |req: Request<Incoming>| {
            let shared = shared.clone();
            let ctx = ctx.clone();
            async move { Ok::<_, Infallible>(router::route_peer(shared, ctx, req).await) }
        })
    };
    serve::serve(listener, tls, limits, make_service, stop).await
}

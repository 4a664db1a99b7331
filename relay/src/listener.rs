//! The HTTPS listener: [`tether_runtime::serve`] (TLS, HTTP/1.1 and HTTP/2, limits) with the relay's shutdown
//! sequence (agents told when to come back, then GOAWAY, grace, cut); requests go to [`crate::router`]. The
//! QUIC listener ([`crate::quic_listener`]) runs beside it and stops with it.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use http::Request;
use hyper::body::Incoming;
use hyper::service::service_fn;
use tether_runtime::serve;
use tether_tunnel::code;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::error::RelayError;
use crate::peer_listener;
use crate::quic_listener;
use crate::replicas;
use crate::router;
use crate::state::{ConnCtx, Shared};

/// The window within which `tunnels` agents should come back to a relay accepting `rate` tunnels per second:
/// `tunnels / rate` seconds, at least one second.
fn reconnect_window(tunnels: usize, rate: u32) -> Duration {
    let ms = (tunnels as u64).saturating_mul(1000) / u64::from(rate.max(1));
    Duration::from_millis(ms.max(1000))
}

/// The accept loop's limits, from the relay's.
fn serve_limits(limits: &crate::config::Limits) -> serve::Limits {
    serve::Limits {
        max_connections: limits.max_connections,
        // Agents present a certificate of the agent CA (the only one the listener verifies).
        cert_budget: Some(limits.max_agent_connections),
        max_handshakes: limits.max_handshakes,
        max_handshakes_per_ip: limits.max_handshakes_per_ip,
        max_connections_per_ip: limits.max_connections_per_ip,
        tls_handshake_timeout: limits.tls_handshake_timeout,
        header_read_timeout: limits.header_read_timeout,
        // Agent tunnels are upgraded (no longer HTTP), so this closes idle user connections only.
        idle_timeout: Some(limits.user_idle_timeout),
        max_header_bytes: limits.max_header_bytes,
        h2_max_concurrent_streams: limits.h2_max_concurrent_streams,
        h2_keep_alive_interval: Some(Duration::from_secs(30)),
        h2_keep_alive_timeout: Duration::from_secs(20),
    }
}

/// What the relay listens on.
pub(crate) struct Listeners {
    /// Users, agents (WebSocket tunnels), operators.
    pub(crate) https: TcpListener,
    /// Its TLS.
    pub(crate) tls: Arc<rustls::ServerConfig>,
    /// QUIC tunnels, unless disabled.
    pub(crate) quic: Option<tether_tunnel::quic::Listener>,
    /// The peer link and its TLS, with `--peer-listen`.
    pub(crate) peer: Option<(TcpListener, Arc<rustls::ServerConfig>)>,
}

/// Accepts connections until `shutdown` resolves, then shuts down gracefully.
pub(crate) async fn serve(
    shared: Arc<Shared>,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RelayError> {
    let Listeners {
        https: listener,
        tls,
        quic,
        peer,
    } = listeners;
    let limits = shared.config.limits.clone();
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "relay listening");
    }
    let stop_quic = CancellationToken::new();
    let quic = quic.map(|quic| {
        let quic = Arc::new(quic);
        let task = tokio::spawn(quic_listener::serve(
            shared.clone(),
            quic.clone(),
            stop_quic.clone(),
        ));
        (quic, task)
    });
    replicas::register(&shared)
        .await
        .map_err(RelayError::Store)?;
    let stop_flusher = CancellationToken::new();
    let flusher = tokio::spawn(flush_activity(shared.clone(), stop_flusher.clone()));
    let lease = tokio::spawn(replicas::lease_loop(shared.clone(), stop_flusher.clone()));
    let svc_shared = shared.clone();
    let make_service = move |conn: serve::Conn| {
        let ctx = ConnCtx::new(conn);
        let shared = svc_shared.clone();
        service_fn(move |req: Request<Incoming>| {
            let shared = shared.clone();
            let ctx = ctx.clone();
            async move { Ok::<_, Infallible>(router::route(shared, ctx, req).await) }
        })
    };
    let stop_peers = CancellationToken::new();
    let peers = peer.map(|(listener, tls)| {
        tokio::spawn(peer_listener::serve(
            shared.clone(),
            listener,
            tls,
            stop_peers.clone().cancelled_owned(),
        ))
    });
    let connections =
        serve::serve(listener, tls, serve_limits(&limits), make_service, shutdown).await;
    tracing::info!("relay shutting down");
    stop_peers.cancel();
    let peer_connections = match peers {
        Some(task) => task.await.ok(),
        None => None,
    };
    stop_quic.cancel();

    let tunnels = shared.registry.all();
    let window = reconnect_window(tunnels.len(), limits.reconnect_rate);
    tracing::info!(tunnels = tunnels.len(), reconnect_within = ?window, "telling agents to reconnect");
    shared.start_shutdown(window);
    for (_, tunnel) in tunnels {
        tunnel.go_away(code::SHUTDOWN, "relay shutting down");
    }
    connections.begin();
    if let Some(peer) = &peer_connections {
        peer.begin();
    }
    shared.tasks.close();
    let grace = limits.shutdown_grace;
    let drained = tokio::time::timeout(grace, async {
        connections.wait().await;
        if let Some(peer) = &peer_connections {
            peer.wait().await;
        }
        shared.tasks.wait().await;
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            ?grace,
            "requests or tunnels still open after the shutdown grace period; closing them"
        );
        for (_, tunnel) in shared.registry.all() {
            tunnel
                .conn
                .close(code::CANCEL, "relay shutting down: grace period over");
        }
        connections.cut();
        if let Some(peer) = &peer_connections {
            peer.cut();
        }
        let cut = tokio::time::timeout(grace, async {
            connections.wait().await;
            if let Some(peer) = &peer_connections {
                peer.wait().await;
            }
            shared.tasks.wait().await;
        })
        .await;
        if cut.is_err() {
            tracing::warn!("some tasks did not stop after being cut; leaving them");
        }
    }
    if let Some((quic, task)) = quic {
        let _ = task.await;
        quic_listener::close(&quic, code::SHUTDOWN, "relay stopped");
    }
    stop_flusher.cancel();
    if flusher.await.is_err() {
        tracing::warn!("the activity writer panicked");
    }
    if lease.await.is_err() {
        tracing::warn!("the lease loop panicked");
    }
    replicas::leave(&shared).await;
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

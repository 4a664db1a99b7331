//! The HTTPS listener: [`tether_runtime::serve`] (TLS, HTTP/1.1 and HTTP/2, limits) with the relay's drain
//! ([`drain`]: readiness off, agents asked to move their tunnels or told when to come back, users served
//! meanwhile, then stop accepting, let requests finish, cut at `--drain-timeout`); requests go to
//! [`crate::router`]. The QUIC listener ([`crate::quic_listener`]) and the peer listener
//! ([`crate::peer_listener`]) run beside it and stop with it. The lease loop, the change follower and the
//! activity writer run until the end.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use http::Request;
use hyper::body::Incoming;
use hyper::service::service_fn;
use tether_runtime::serve;
use tether_runtime::shards::Shards;
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
    /// Shards to serve the HTTPS listener's connections on (each user's with its cluster's tunnel), if any.
    pub(crate) shards: Option<Arc<Shards>>,
}

/// How long the start of a drain waits for the store to record it (the lease loop retries anyway).
const MARK_DRAINING: Duration = Duration::from_secs(2);

/// How long what is left after the drain timeout, once cut, may take to stop.
const AFTER_CUT: Duration = Duration::from_secs(5);

/// Serves until `shutdown` resolves, then drains (see [`drain`]) and stops.
pub(crate) async fn serve(
    shared: Arc<Shared>,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RelayError> {
    let Listeners {
        https,
        tls,
        quic,
        peer,
        shards,
    } = listeners;
    let limits = shared.config.limits.clone();
    if let Ok(addr) = https.local_addr() {
        tracing::info!(%addr, replica = %shared.fleet.replica_id, "relay listening");
    }
    replicas::register(&shared)
        .await
        .map_err(RelayError::Store)?;
    let stop_background = CancellationToken::new();
    let flusher = tokio::spawn(flush_activity(shared.clone(), stop_background.clone()));
    let lease = tokio::spawn(replicas::lease_loop(
        shared.clone(),
        stop_background.clone(),
    ));
    let follower = tokio::spawn(replicas::follow_changes(
        shared.clone(),
        stop_background.clone(),
    ));
    let stop_quic = CancellationToken::new();
    let quic = quic.map(|quic| {
        let quic = Arc::new(quic);
        let task = tokio::spawn(quic_listener::serve(
            shared.clone(),
            quic.clone(),
            shards.clone(),
            stop_quic.clone(),
        ));
        (quic, task)
    });
    // Both listeners keep accepting through the first part of a drain (users still reach the tunnels being
    // moved, and this replica forwards to its peers); they stop together.
    let stop_accepting = CancellationToken::new();
    let peers = peer.map(|(listener, tls)| {
        tokio::spawn(peer_listener::serve(
            shared.clone(),
            listener,
            tls,
            stop_accepting.clone().cancelled_owned(),
        ))
    });
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
    let sharding = shards.map(|shards| {
        let shared = shared.clone();
        serve::Sharding {
            shards,
            place: Arc::new(move |target: &str| router::place(&shared, target)),
        }
    });
    let users = tokio::spawn(serve::serve_on(
        https,
        tls,
        serve_limits(&limits),
        make_service,
        sharding,
        stop_accepting.clone().cancelled_owned(),
    ));

    shutdown.await;
    let deadline = tokio::time::Instant::now() + limits.shutdown_grace;
    stop_quic.cancel();
    drain(&shared, deadline).await;

    // No tunnel here takes new requests (or the timeout is reached): stop accepting, and let what is in flight
    // finish; watches end cleanly at once (below).
    stop_accepting.cancel();
    let mut connections = Vec::new();
    if let Ok(draining) = users.await {
        connections.push(draining);
    }
    if let Some(task) = peers
        && let Ok(draining) = task.await
    {
        connections.push(draining);
    }
    for c in &connections {
        c.begin();
    }
    // Watches would otherwise run until the cut and end with an ERROR event; ended cleanly, their clients
    // watch again (from their last resourceVersion) on a new connection, which the load balancer sends to a
    // ready replica. A moment after the GOAWAY above, so that HTTP/2 clients have read it and do not send the
    // new watch (or its re-list) on this connection just as it closes.
    let end_watches = {
        let shared = shared.clone();
        tokio::spawn(async move {
            tokio::time::sleep_until(deadline.min(tokio::time::Instant::now() + WATCHES_END_AFTER))
                .await;
            shared.watches_end.cancel();
        })
    };
    shared.tasks.close();
    let drained = tokio::time::timeout_at(deadline, async {
        for c in &connections {
            c.wait().await;
        }
        shared.tasks.wait().await;
        shared.registry.until_empty().await;
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            drain_timeout = ?limits.shutdown_grace,
            "requests or tunnels still open at the drain timeout; closing them"
        );
        for (_, tunnel) in shared.registry.all() {
            tunnel
                .conn
                .close(code::CANCEL, "relay shutting down: drain timeout reached");
        }
        shared.cut.cancel();
        for c in &connections {
            c.cut();
        }
        let cut = tokio::time::timeout(AFTER_CUT, async {
            for c in &connections {
                c.wait().await;
            }
            shared.tasks.wait().await;
        })
        .await;
        if cut.is_err() {
            tracing::warn!("some tasks did not stop after being cut; leaving them");
        }
    }
    end_watches.abort();
    if let Some((quic, task)) = quic {
        let _ = task.await;
        quic_listener::close(&quic, code::SHUTDOWN, "relay stopped");
    }
    stop_background.cancel();
    for (what, task) in [
        ("activity writer", flusher),
        ("lease loop", lease),
        ("change follower", follower),
    ] {
        if task.await.is_err() {
            tracing::warn!("the {what} panicked");
        }
    }
    replicas::leave(&shared).await;
    if let Err(e) = shared.store.close().await {
        tracing::warn!(error = %e, "closing the store failed");
    }
    tracing::info!("relay stopped");
    Ok(())
}

/// The first part of a drain, until no tunnel here takes new requests or `deadline`:
/// 1. `/readyz` answers 503 and new tunnels are refused (the load balancer and the agents go elsewhere), and
///    the store marks this replica draining (its peers route elsewhere first);
/// 2. with another live replica to move to, each agent is asked to move its tunnel (`draining` with make
///    before break): it opens the replacement elsewhere, then sends GOAWAY here, and this replica serves the
///    tunnel's streams, and new requests on it, until then; without one, each tunnel gets GOAWAY at once and
///    its agent is told when to come back (`draining` with a window);
/// 3. meanwhile users are still served: on the tunnels not moved yet, else through the peer link.
async fn drain(shared: &Arc<Shared>, deadline: tokio::time::Instant) {
    shared.start_drain();
    if tokio::time::timeout(MARK_DRAINING, replicas::renew(shared))
        .await
        .is_err()
    {
        tracing::warn!("the store did not record the drain in time; the lease loop will");
    }
    let tunnels = shared.registry.all();
    let window = reconnect_window(tunnels.len(), shared.config.limits.reconnect_rate);
    shared.set_reconnect_window(window);
    if shared.fleet.peers_available() {
        tracing::info!(tunnels = tunnels.len(), drain_timeout = ?shared.config.limits.shutdown_grace, "draining: asking agents to move their tunnels to another replica");
        for (_, tunnel) in &tunnels {
            tunnel.info.moving.cancel();
        }
    } else {
        tracing::info!(tunnels = tunnels.len(), reconnect_within = ?window, "draining: no other replica to move to; telling agents to reconnect");
        for (_, tunnel) in &tunnels {
            tunnel.go_away(code::SHUTDOWN, "relay shutting down");
        }
    }
    // With a replica to move to: until every tunnel here has moved (a tunnel that got GOAWAY takes no new
    // request; the streams still on it — watches, logs -f, exec — are what is left to end, and new users are
    // better served by the load balancer's other replicas). Alone: until no tunnel is left (GOAWAY ended its
    // watches cleanly; the users still reaching this relay get a 503 that says it is shutting down, not a
    // refused connection).
    let with_peers = shared.fleet.peers_available();
    let moved = async {
        if with_peers {
            // And not before the load balancer had time to see the readiness change.
            let limits = &shared.config.limits;
            tokio::time::sleep(limits.drain_delay.min(limits.shutdown_grace / 2)).await;
            while shared.registry.all().iter().any(|(_, t)| t.is_usable()) {
                tokio::time::sleep(DRAIN_POLL).await;
            }
        } else {
            shared.registry.until_empty().await;
        }
    };
    if tokio::time::timeout_at(deadline, moved).await.is_err() {
        tracing::warn!(
            tunnels = shared.registry.len(),
            "tunnels still taking requests at the drain timeout"
        );
    } else {
        tracing::info!(
            tunnels = shared.registry.len(),
            "drained: no tunnel here takes new requests; ending watches and connections"
        );
    }
}

/// How long after user connections were told to close (HTTP/2 GOAWAY) their watches are ended.
const WATCHES_END_AFTER: Duration = Duration::from_secs(1);

/// How often the first part of a drain looks whether every tunnel here has moved.
const DRAIN_POLL: Duration = Duration::from_millis(50);

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

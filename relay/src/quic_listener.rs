//! The UDP listener for QUIC agent tunnels, beside the HTTPS listener (same port number by default).
//!
//! Until an agent is authenticated it costs the relay a bounded amount: at most `max_quic_handshakes`
//! handshakes are in progress at once (past it an attempt is refused before quinn keeps any state for it),
//! and each must finish — QUIC and TLS handshake, the agent's HELLO, the identity check — within
//! `tls_handshake_timeout`, or it is dropped. An agent cannot open a stream before it is authenticated (the
//! relay grants stream credit only on [`tether_tunnel::quic::PendingTunnel::accept`]). Once accepted, the
//! tunnel is handed to [`crate::tunnels`] like a WebSocket one.

use std::net::SocketAddr;
use std::sync::Arc;

use tether_runtime::shards::Shards;
use tether_tunnel::quic::Listener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::error::RelayError;
use crate::handlers::agent;
use crate::state::Shared;

/// Binds the QUIC listener: at `config.quic_listen`, else at `https` (the HTTPS listener's address). `None`
/// with `--no-quic`, or when the default address cannot be bound (logged: agents then use WebSocket); an
/// address given explicitly must bind.
pub(crate) fn bind(
    config: &crate::config::Config,
    https: Option<SocketAddr>,
    tls: Arc<rustls::ServerConfig>,
) -> Result<Option<Listener>, RelayError> {
    if config.no_quic {
        return Ok(None);
    }
    let (addr, explicit) = match (config.quic_listen, https) {
        (Some(addr), _) => (addr, true),
        (None, Some(addr)) => (addr, false),
        (None, None) => return Ok(None),
    };
    match Listener::bind(addr, tls, config.quic_session()) {
        Ok(listener) => Ok(Some(listener)),
        Err(e) if !explicit => {
            tracing::warn!(%addr, error = %e, "cannot listen for QUIC tunnels on the HTTPS port number; agents will use WebSocket (set --quic-listen or --no-quic)");
            Ok(None)
        }
        Err(e) => Err(RelayError::Io {
            what: "cannot listen for QUIC on",
            path: addr.to_string(),
            source: std::io::Error::other(e.to_string()),
        }),
    }
}

/// Accepts QUIC tunnels until `stop` is cancelled; then new attempts are refused (tunnels already up go on:
/// the listener's caller drains and closes them).
///
/// With `shards`, each tunnel is accepted and then driven on the next shard in turn (quinn spawns a
/// connection's driver where it is accepted), and users of its cluster are served there (`crate::router::place`).
pub(crate) async fn serve(
    shared: Arc<Shared>,
    listener: Arc<Listener>,
    shards: Option<Arc<Shards>>,
    stop: CancellationToken,
) {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "relay listening for QUIC tunnels");
    }
    let limits = &shared.config.limits;
    let slots = Arc::new(Semaphore::new(limits.max_quic_handshakes));
    let timeout = limits.tls_handshake_timeout;
    loop {
        let handshake = tokio::select! {
            () = stop.cancelled() => break,
            handshake = listener.accept() => match handshake {
                Some(handshake) => handshake,
                None => break,
            },
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::debug!(peer = %handshake.remote_address(), "too many QUIC handshakes in progress; refused");
            handshake.refuse();
            continue;
        };
        let shared = shared.clone();
        let accepted = async move {
            let peer = handshake.remote_address();
            let work = async {
                match handshake.finish().await {
                    Ok(pending) => {
                        agent::quic_tunnel(&shared, pending).await;
                    }
                    Err(e) => {
                        tracing::debug!(%peer, error = %e, "QUIC tunnel handshake failed");
                    }
                }
            };
            // Dropping the unfinished work drops its connection (refused with code REFUSED).
            if tokio::time::timeout(timeout, work).await.is_err() {
                tracing::info!(%peer, ?timeout, "QUIC tunnel handshake timed out");
            }
            drop(slot);
        };
        match &shards {
            Some(shards) => drop(shards.handle(shards.next()).spawn(accepted)),
            None => drop(tokio::spawn(accepted)),
        }
    }
    listener.stop_accepting();
}

/// Closes every QUIC connection left (after the shutdown grace).
pub(crate) fn close(listener: &Listener, code: u32, reason: &str) {
    listener.close(code, reason);
}

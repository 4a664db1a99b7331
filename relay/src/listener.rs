//! The HTTPS listener: TLS, HTTP/1.1 and HTTP/2, limits and graceful shutdown; requests go to [`crate::router`].

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use http::Request;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tether_tunnel::code;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::RelayError;
use crate::router;
use crate::state::{ConnCtx, Shared};

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

    let tunnels = shared.registry.all();
    let window = reconnect_window(tunnels.len(), limits.reconnect_rate);
    tracing::info!(tunnels = tunnels.len(), reconnect_within = ?window, "telling agents to reconnect");
    shared.start_shutdown(window);
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
        async move { Ok::<_, Infallible>(router::route(shared, ctx, req).await) }
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

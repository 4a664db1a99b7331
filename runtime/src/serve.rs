//! The one TLS + HTTP accept loop every Tether server uses: TLS (ALPN `h2` and `http/1.1` as the
//! `rustls::ServerConfig` says), HTTP/1.1 or HTTP/2 per connection (hyper-util's `auto` builder), upgrades
//! (WebSocket, `101` pipes), the client certificate handed to the service, a connection limit, a TLS-handshake
//! and a header-read timeout, and a graceful shutdown in two steps the caller drives ([`Draining`]).
//!
//! ```no_run
//! # async fn example(listener: tokio::net::TcpListener, tls: std::sync::Arc<rustls::ServerConfig>) {
//! use std::convert::Infallible;
//! use tether_runtime::serve::{self, Limits};
//!
//! let make = |_conn: serve::Conn| {
//!     hyper::service::service_fn(|_req| async {
//!         Ok::<_, Infallible>(http::Response::new(http_body_util::Full::new(bytes::Bytes::from("ok"))))
//!     })
//! };
//! let draining = serve::serve(listener, tls, Limits::default(), make, tether_runtime::process::shutdown_signal()).await;
//! draining.finish(std::time::Duration::from_secs(10)).await;
//! # }
//! ```

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::{Body, Incoming};
use hyper::service::Service;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use rustls::pki_types::CertificateDer;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Errors a service or body may return.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The limits of one listener.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Most concurrent connections; past it, new connections wait in the kernel's backlog. Taken as at least 1
    /// and at most `tokio::sync::Semaphore::MAX_PERMITS` (`usize::MAX` means no limit).
    pub max_connections: usize,
    /// How long a client has to finish the TLS handshake.
    pub tls_handshake_timeout: Duration,
    /// How long an HTTP/1.1 client has to send a request's headers.
    pub header_read_timeout: Duration,
    /// Largest request head (HTTP/1.1 buffer, HTTP/2 header list).
    pub max_header_bytes: usize,
    /// Most concurrent HTTP/2 streams per connection.
    pub h2_max_concurrent_streams: u32,
    /// HTTP/2 keep-alive ping interval (`None`: no pings).
    pub h2_keep_alive_interval: Option<Duration>,
    /// How long to wait for a keep-alive ping's answer.
    pub h2_keep_alive_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 10_000,
            tls_handshake_timeout: Duration::from_secs(10),
            header_read_timeout: Duration::from_secs(30),
            max_header_bytes: 64 * 1024,
            h2_max_concurrent_streams: 250,
            h2_keep_alive_interval: Some(Duration::from_secs(30)),
            h2_keep_alive_timeout: Duration::from_secs(20),
        }
    }
}

/// What the service of one connection knows about it.
#[derive(Debug, Clone)]
pub struct Conn {
    /// The peer's address.
    pub peer: SocketAddr,
    /// The first certificate of the chain the client presented (verified by the `ServerConfig`'s client
    /// verifier, if it has one).
    pub client_cert: Option<Arc<CertificateDer<'static>>>,
    /// The connection's slot under [`Limits::max_connections`], held by the accept loop until the HTTP connection
    /// ends; keep a clone for as long as anything (an upgraded pipe, a tunnel) still uses it after that, so the
    /// limit counts it.
    pub permit: Arc<OwnedSemaphorePermit>,
}

/// A listener that stopped accepting: its connections are still served until the caller ends them.
#[derive(Debug)]
pub struct Draining {
    connections: TaskTracker,
    graceful: CancellationToken,
    hard: CancellationToken,
}

impl Draining {
    /// Asks every connection to finish: HTTP/1.1 closes after the current response, HTTP/2 sends GOAWAY.
    /// Upgraded connections are not affected.
    pub fn begin(&self) {
        self.connections.close();
        self.graceful.cancel();
    }

    /// Waits until every connection has ended (call [`Draining::begin`] first).
    pub async fn wait(&self) {
        self.connections.wait().await;
    }

    /// Drops every connection still open.
    pub fn cut(&self) {
        self.connections.close();
        self.hard.cancel();
    }

    /// [`Draining::begin`], then waits up to `grace`, then [`Draining::cut`]s; true if all ended in time.
    pub async fn finish(self, grace: Duration) -> bool {
        self.begin();
        if tokio::time::timeout(grace, self.wait()).await.is_ok() {
            return true;
        }
        self.cut();
        let _ = tokio::time::timeout(grace, self.wait()).await;
        false
    }
}

/// Accepts TLS connections on `listener` and serves each with the service `make_service` builds for it, until
/// `shutdown` resolves; then stops accepting and returns the connections still open, to drain.
pub async fn serve<M, S, B>(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    limits: Limits,
    make_service: M,
    shutdown: impl Future<Output = ()>,
) -> Draining
where
    M: Fn(Conn) -> S + Send + Sync + 'static,
    S: Service<hyper::Request<Incoming>, Response = hyper::Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let make_service = Arc::new(make_service);
    let acceptor = TlsAcceptor::from(tls);
    let slots = Arc::new(Semaphore::new(
        limits.max_connections.clamp(1, Semaphore::MAX_PERMITS),
    ));
    let draining = Draining {
        connections: TaskTracker::new(),
        graceful: CancellationToken::new(),
        hard: CancellationToken::new(),
    };
    let limits = Arc::new(limits);
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
                Err(e) => {
                    // Typically out of file descriptors (or a connection reset before it was accepted): back
                    // off instead of spinning; the listener itself stays usable.
                    tracing::warn!(error = %e, "accept failed; retrying");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let _ = tcp.set_nodelay(true);
        draining.connections.spawn(serve_connection(
            acceptor.clone(),
            tcp,
            peer,
            Arc::new(permit),
            limits.clone(),
            make_service.clone(),
            draining.graceful.clone(),
            draining.hard.clone(),
        ));
    }
    draining
}

#[allow(clippy::too_many_arguments)]
async fn serve_connection<M, S, B>(
    acceptor: TlsAcceptor,
    tcp: TcpStream,
    peer: SocketAddr,
    permit: Arc<OwnedSemaphorePermit>,
    limits: Arc<Limits>,
    make_service: Arc<M>,
    graceful: CancellationToken,
    hard: CancellationToken,
) where
    M: Fn(Conn) -> S + Send + Sync + 'static,
    S: Service<hyper::Request<Incoming>, Response = hyper::Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    // The slot is held until the connection ends, whether or not the service keeps its `Conn`.
    let _slot = permit.clone();
    let tls = tokio::select! {
        () = graceful.cancelled() => return,
        () = hard.cancelled() => return,
        r = tokio::time::timeout(limits.tls_handshake_timeout, acceptor.accept(tcp)) => match r {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => {
                tracing::debug!(%peer, error = %e, "TLS handshake failed");
                return;
            }
            Err(_) => {
                tracing::debug!(%peer, "TLS handshake timed out");
                return;
            }
        },
    };
    let client_cert = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|chain| chain.first())
        .map(|cert| Arc::new(cert.clone().into_owned()));
    let service = make_service(Conn {
        peer,
        client_cert,
        permit,
    });

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
        .keep_alive_interval(limits.h2_keep_alive_interval)
        .keep_alive_timeout(limits.h2_keep_alive_timeout);
    let conn = builder.serve_connection_with_upgrades(TokioIo::new(tls), service);
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
        tracing::debug!(%peer, error = %e, "connection ended with an error");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    #[tokio::test]
    async fn cut_ends_a_connection_stuck_in_its_tls_handshake() -> anyhow::Result<()> {
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()])?;
        let cert_pem = cert.cert.pem();
        let tls = crate::tls::server_config(
            cert_pem.as_bytes(),
            cert.signing_key.serialize_pem().as_bytes(),
        )?;
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let limits = Limits {
            // Far longer than the deadline below: only `cut` can end the handshake in time.
            tls_handshake_timeout: Duration::from_secs(3600),
            ..Limits::default()
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let make = |_conn: Conn| {
            hyper::service::service_fn(|_req| async {
                Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Full::new(
                    bytes::Bytes::from("ok"),
                )))
            })
        };
        let server = tokio::spawn(serve(listener, tls, limits, make, async move {
            let _ = stopped.await;
        }));

        // A client that connects and never sends its ClientHello...
        let _silent = tokio::net::TcpStream::connect(addr).await?;
        // ...then one served in full: connections are accepted in order, so the silent one was accepted first.
        let client = crate::tls::client_config(Some(cert_pem.as_bytes()), &[b"http/1.1"])?;
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let name = rustls::pki_types::ServerName::try_from("localhost")?;
        let mut stream = tokio_rustls::TlsConnector::from(client)
            .connect(name, tcp)
            .await?;
        stream
            .write_all(b"GET / HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n")
            .await?;
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(60), stream.read_to_end(&mut answer)).await??;
        assert!(answer.starts_with(b"HTTP/1.1 200"), "{answer:?}");

        let _ = stop.send(());
        let draining = server.await?;
        draining.cut();
        tokio::time::timeout(Duration::from_secs(60), draining.wait()).await?;
        Ok(())
    }
}

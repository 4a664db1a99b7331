//! One pooled connection to the apiserver ([`crate::pool`] keeps several).
//!
//! When the apiserver speaks HTTP/2 (ALPN `h2`, as kube-apiserver does over TLS), a slot is one hyper HTTP/2
//! client connection used directly: a request is handed to its `SendRequest` under a lock, with no pool checkout
//! keyed by host, no boxed lazy connect and no URI rewriting in front of it, which hyper-util's legacy client
//! did for every request (docs/BENCHMARKS.md, seventh pass). An apiserver that speaks only HTTP/1.1, or an
//! `http://` URL, gets hyper-util's client instead, whose keep-alive connections carry one request at a time.
//!
//! The HTTP/2 connection is made by the first request (one connect at a time: requests arriving meanwhile wait
//! for it and share it), made again by the next request once it has closed (GOAWAY, an error, the apiserver
//! restarting), and closed after [`Settings::idle`] with no request open on it. A request the connection closed
//! before it was sent is sent once more on a new connection, as hyper-util's client does.

use std::pin::Pin;
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, Uri};
use hyper::body::Incoming;
use hyper::client::conn::http2;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connection as _, HttpConnector};
use hyper_util::rt::TokioTimer;
use tether_tunnel::heads::{BodyReader, ReadChunk};
use tower::ServiceExt as _;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The TCP + TLS connector to the apiserver, bounded by the connect timeout.
pub(crate) type Connector = TimeoutConnector<HttpsConnector<HttpConnector>>;

/// hyper-util's pooled client: the HTTP/1.1 fallback, and the upgrade client.
pub(crate) type LegacyClient = Client<Connector, ReqBody>;

/// The body of a request sent upstream: hyper's (an HTTP/1.1 stream), the bytes after the head on a stream of
/// kind `HTTP_HEADS`, or none.
pub(crate) enum ReqBody {
    /// From the HTTP/1.1 server on a stream of kind `HTTP`.
    Http1(Incoming),
    /// The rest of a stream of kind `HTTP_HEADS`.
    Stream(BodyReader<Box<dyn ReadChunk + Send>>),
    /// No body.
    Empty,
}

impl http_body::Body for ReqBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            ReqBody::Http1(b) => Pin::new(b).poll_frame(cx).map_err(Into::into),
            ReqBody::Stream(b) => Pin::new(b).poll_frame(cx).map_err(Into::into),
            ReqBody::Empty => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ReqBody::Http1(b) => b.is_end_stream(),
            ReqBody::Stream(b) => b.is_end_stream(),
            ReqBody::Empty => true,
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self {
            ReqBody::Http1(b) => b.size_hint(),
            ReqBody::Stream(b) => b.size_hint(),
            ReqBody::Empty => http_body::SizeHint::with_exact(0),
        }
    }
}

/// What a pool's connections share: where and how to connect, and what the apiserver was found to speak.
pub(crate) struct Settings {
    /// `scheme://authority` of the apiserver: what the connector dials.
    base: Uri,
    /// TCP and TLS, ALPN `h2` and `http/1.1` offered.
    connector: Connector,
    http2: Http2,
    /// Builds the HTTP/1.1 client of a slot, when the apiserver turns out not to speak HTTP/2.
    legacy: Box<dyn Fn() -> LegacyClient + Send + Sync>,
    /// [`PROTOCOL_UNKNOWN`], [`PROTOCOL_H2`] or [`PROTOCOL_HTTP1`]: learnt by the first connect.
    protocol: AtomicU8,
    /// Numbers the HTTP/2 connections made, for the logs.
    made: AtomicU64,
}

/// How the HTTP/2 connections are made and kept.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Http2 {
    /// Bounds the HTTP/2 handshake after the connector's own timeout.
    pub(crate) connect_timeout: Duration,
    /// HTTP/2 receive window of each stream.
    pub(crate) stream_window: u32,
    /// HTTP/2 receive window of the whole connection.
    pub(crate) connection_window: u32,
    /// A connection with no request open for this long is closed.
    pub(crate) idle: Duration,
}

const PROTOCOL_UNKNOWN: u8 = 0;
const PROTOCOL_H2: u8 = 1;
const PROTOCOL_HTTP1: u8 = 2;

impl Settings {
    /// Settings for `base`; an `http://` apiserver is spoken to in HTTP/1.1 from the start (no prior-knowledge
    /// HTTP/2 without TLS, as hyper-util's client does).
    pub(crate) fn new(
        base: Uri,
        connector: Connector,
        http2: Http2,
        legacy: impl Fn() -> LegacyClient + Send + Sync + 'static,
    ) -> Self {
        let protocol = if base.scheme() == Some(&http::uri::Scheme::HTTPS) {
            PROTOCOL_UNKNOWN
        } else {
            PROTOCOL_HTTP1
        };
        Self {
            base,
            connector,
            http2,
            legacy: Box::new(legacy),
            protocol: AtomicU8::new(protocol),
            made: AtomicU64::new(0),
        }
    }

    fn speaks_http1(&self) -> bool {
        self.protocol.load(Ordering::Acquire) == PROTOCOL_HTTP1
    }
}

/// Why a request could not be sent upstream or got no response head.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SendError {
    /// TCP, TLS or the HTTP/2 handshake failed (or timed out: [`ConnectTimedOut`] in the chain).
    #[error("cannot connect: {0}")]
    Connect(#[source] BoxError),
    /// The HTTP/2 connection failed the request.
    #[error(transparent)]
    Request(hyper::Error),
    /// hyper-util's client (HTTP/1.1) failed the request.
    #[error(transparent)]
    Legacy(hyper_util::client::legacy::Error),
}

impl SendError {
    /// Whether no connection to the apiserver could be made.
    pub(crate) fn is_connect(&self) -> bool {
        match self {
            SendError::Connect(_) => true,
            SendError::Request(_) => false,
            SendError::Legacy(e) => e.is_connect(),
        }
    }
}

/// One slot of the pool: an HTTP/2 connection made on demand, or hyper-util's HTTP/1.1 client.
pub(crate) struct Conn {
    settings: Arc<Settings>,
    /// The pool's count of requests open on this slot (a request stays open until its body is done).
    open: Arc<AtomicUsize>,
    state: Arc<State>,
}

struct State {
    /// The live HTTP/2 connection's sender, if any.
    sender: Mutex<Option<Live>>,
    /// Held while connecting, so concurrent requests make one connection.
    connecting: tokio::sync::Mutex<()>,
    /// Requests sent on this slot so far (the idle check's clock).
    sent: AtomicU64,
    /// Connect attempts finished, and why the last one failed (`None`: it succeeded).
    attempts: AtomicU64,
    last_failure: Mutex<Option<Arc<dyn std::error::Error + Send + Sync>>>,
    /// This slot's HTTP/1.1 client, built when first needed.
    legacy: OnceLock<LegacyClient>,
}

struct Live {
    send: http2::SendRequest<ReqBody>,
    /// Which connection this is ([`Settings::made`]).
    id: u64,
}

impl State {
    fn sender(&self) -> std::sync::MutexGuard<'_, Option<Live>> {
        self.sender.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Forgets connection `id` if it is still the slot's, so the next request makes a new one.
fn forget(sender: &mut Option<Live>, id: u64) {
    if sender.as_ref().is_some_and(|live| live.id == id) {
        *sender = None;
    }
}

impl Conn {
    /// A slot that has not connected yet; `open` is the pool's count of requests open on it.
    pub(crate) fn new(settings: Arc<Settings>, open: Arc<AtomicUsize>) -> Self {
        Self {
            settings,
            open,
            state: Arc::new(State {
                sender: Mutex::new(None),
                connecting: tokio::sync::Mutex::new(()),
                sent: AtomicU64::new(0),
                attempts: AtomicU64::new(0),
                last_failure: Mutex::new(None),
                legacy: OnceLock::new(),
            }),
        }
    }

    /// Sends `req` (an absolute URI naming the apiserver) and waits for the response head.
    pub(crate) async fn send(
        &self,
        mut req: Request<ReqBody>,
    ) -> Result<Response<Incoming>, SendError> {
        if self.settings.speaks_http1() {
            return Box::pin(self.send_http1(req)).await;
        }
        let mut fresh = false;
        loop {
            // Handed to the live connection under the lock, awaited after it (the future owns what it needs).
            let sending = {
                let mut sender = self.state.sender();
                match sender.as_mut() {
                    Some(live) if !live.send.is_closed() => {
                        self.state.sent.fetch_add(1, Ordering::Relaxed);
                        Ok((live.send.try_send_request(req), live.id))
                    }
                    _ => Err(req),
                }
            };
            let (response, id) = match sending {
                Ok(sent) => sent,
                Err(back) => {
                    req = back;
                    // Boxed: connecting is rare, and its state (connector, TLS and HTTP/2 handshakes) would
                    // otherwise make every request's future, which is moved around, that much larger.
                    if !Box::pin(self.connect()).await? {
                        return Box::pin(self.send_http1(req)).await;
                    }
                    fresh = true;
                    continue;
                }
            };
            match response.await {
                Ok(response) => return Ok(response),
                Err(mut e) => {
                    let unsent = e.take_message();
                    self.forget_if_closed(id);
                    match unsent {
                        // The connection went away before it took the request: once more, on a new one, unless
                        // the connection was new already.
                        Some(back) if !fresh => {
                            tracing::debug!(error = %e.error(), "upstream connection closed before a request was sent; sending it again");
                            req = back;
                            fresh = true;
                        }
                        _ => return Err(SendError::Request(e.into_error())),
                    }
                }
            }
        }
    }

    async fn send_http1(&self, req: Request<ReqBody>) -> Result<Response<Incoming>, SendError> {
        self.state.sent.fetch_add(1, Ordering::Relaxed);
        let client = self.state.legacy.get_or_init(|| (self.settings.legacy)());
        client.request(req).await.map_err(SendError::Legacy)
    }

    /// Drops connection `id` if it has closed, so the next request makes a new one.
    fn forget_if_closed(&self, id: u64) {
        let mut sender = self.state.sender();
        if sender.as_ref().is_some_and(|live| live.send.is_closed()) {
            forget(&mut sender, id);
        }
    }

    /// Makes the HTTP/2 connection unless another request did meanwhile. `Ok(false)`: the apiserver does not
    /// speak HTTP/2 (use the HTTP/1.1 client). Requests that waited for a connect that failed get its error
    /// instead of each trying (and timing out) in turn.
    async fn connect(&self) -> Result<bool, SendError> {
        let attempts = self.state.attempts.load(Ordering::Acquire);
        let _one_at_a_time = self.state.connecting.lock().await;
        if self.settings.speaks_http1() {
            return Ok(false);
        }
        if self
            .state
            .sender()
            .as_ref()
            .is_some_and(|live| !live.send.is_closed())
        {
            return Ok(true);
        }
        if self.state.attempts.load(Ordering::Acquire) != attempts
            && let Some(failure) = self
                .state
                .last_failure
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone()
        {
            return Err(SendError::Connect(Box::new(Shared(failure))));
        }
        let made = self.make().await;
        let failure = made.as_ref().err().cloned();
        *self
            .state
            .last_failure
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = failure;
        self.state.attempts.fetch_add(1, Ordering::Release);
        made.map_err(|failure| SendError::Connect(Box::new(Shared(failure))))
    }

    /// One connect: TCP, TLS, and the HTTP/2 handshake when ALPN chose `h2` (`Ok(false)` when it did not).
    async fn make(&self) -> Result<bool, Arc<dyn std::error::Error + Send + Sync>> {
        let settings = &self.settings;
        let io = settings
            .connector
            .clone()
            .oneshot(settings.base.clone())
            .await
            .map_err(Arc::from)?;
        if !io.connected().is_negotiated_h2() {
            if settings.protocol.swap(PROTOCOL_HTTP1, Ordering::AcqRel) != PROTOCOL_HTTP1 {
                tracing::info!(apiserver = %settings.base, "the apiserver did not offer HTTP/2; using HTTP/1.1 keep-alive connections");
            }
            return Ok(false);
        }
        settings.protocol.store(PROTOCOL_H2, Ordering::Release);
        let handshake = http2::Builder::new(Boxed)
            .timer(TokioTimer::new())
            .initial_stream_window_size(settings.http2.stream_window)
            .initial_connection_window_size(settings.http2.connection_window)
            .handshake(io);
        let (send, connection) =
            match tokio::time::timeout(settings.http2.connect_timeout, handshake).await {
                Ok(Ok(made)) => made,
                Ok(Err(e)) => return Err(Arc::new(e)),
                Err(_) => return Err(Arc::new(ConnectTimedOut(settings.http2.connect_timeout))),
            };
        let id = settings.made.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(apiserver = %settings.base, connection = id, "HTTP/2 connection to the apiserver made");
        tokio::spawn(drive(
            connection,
            Arc::downgrade(&self.state),
            self.open.clone(),
            id,
            settings.http2.idle,
        ));
        *self.state.sender() = Some(Live { send, id });
        Ok(true)
    }
}

/// A connect failure, shared by the requests that waited for that connect: shows as the failure itself, whose
/// causes (a [`ConnectTimedOut`] among them) stay in the chain.
#[derive(Debug)]
struct Shared(Arc<dyn std::error::Error + Send + Sync>);

impl std::fmt::Display for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for Shared {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

/// Quiet checks in a row (one every quarter of the idle timeout) after which a connection is closed: the first
/// finds it quiet, four more span the timeout.
const QUIET_CHECKS: u32 = 5;

/// Runs HTTP/2 connection `id` until it closes, the slot is gone, or no request was open on it for `idle`.
async fn drive<IO>(
    connection: http2::Connection<IO, ReqBody, Boxed>,
    state: Weak<State>,
    open: Arc<AtomicUsize>,
    id: u64,
    idle: Duration,
) where
    IO: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    tokio::pin!(connection);
    let check = idle / (QUIET_CHECKS - 1);
    let mut quiet = 0;
    let mut sent_before = None;
    loop {
        tokio::select! {
            result = &mut connection => {
                if let Err(e) = result {
                    tracing::debug!(connection = id, error = %e, "HTTP/2 connection to the apiserver ended");
                }
                if let Some(state) = state.upgrade() {
                    forget(&mut state.sender(), id);
                }
                return;
            }
            () = tokio::time::sleep(check) => {
                let Some(state) = state.upgrade() else { return };
                // Under the lock requests take the connection with, so none takes it while it is closed.
                let mut sender = state.sender();
                let sent = state.sent.load(Ordering::Relaxed);
                quiet = match (open.load(Ordering::Acquire), sent_before == Some(sent)) {
                    (0, true) => quiet + 1,
                    (0, false) => 1,
                    _ => 0,
                };
                sent_before = Some(sent);
                if quiet >= QUIET_CHECKS {
                    forget(&mut sender, id);
                    tracing::debug!(connection = id, "closing an idle HTTP/2 connection to the apiserver");
                    return;
                }
            }
        }
    }
}

/// Spawns what hyper's HTTP/2 connection hands it (a task per request, for the response) boxed: a task
/// holding a box is small, so creating and finishing it moves a pointer instead of the whole future (as
/// hyper-util's client did; callgrind counted ~1.9k instructions per small GET for the two moves unboxed).
#[derive(Clone, Copy)]
struct Boxed;

impl<F> hyper::rt::Executor<F> for Boxed
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, future: F) {
        tokio::spawn(Box::pin(future));
    }
}

/// Marks a connect attempt that ran out of time, so the caller can answer 504 instead of 502.
#[derive(Debug, thiserror::Error)]
#[error("connecting to the apiserver timed out after {0:?}")]
pub(crate) struct ConnectTimedOut(pub(crate) Duration);

/// Bounds the whole connect (TCP and TLS handshake) with one timeout.
#[derive(Clone)]
pub(crate) struct TimeoutConnector<C> {
    pub(crate) inner: C,
    pub(crate) timeout: Duration,
}

impl<C> tower::Service<Uri> for TimeoutConnector<C>
where
    C: tower::Service<Uri> + Send + 'static,
    C::Future: Send + 'static,
    C::Error: Into<BoxError>,
{
    type Response = C::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<C::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, dst: Uri) -> Self::Future {
        let timeout = self.timeout;
        let connecting = self.inner.call(dst);
        Box::pin(async move {
            match tokio::time::timeout(timeout, connecting).await {
                Ok(result) => result.map_err(Into::into),
                Err(_) => Err(Box::new(ConnectTimedOut(timeout)) as BoxError),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use anyhow::{Context as _, Result, bail};
    use http_body_util::BodyExt as _;
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use tether_testkit::certs::{self, Ca};
    use tokio::net::TcpListener;
    use tokio::sync::{Notify, watch};

    use super::*;

    /// A TLS server offering `alpn` that answers every request with its HTTP version, counting connections
    /// accepted and open; `kill` drops every open connection, `goaway` shuts them down gracefully (HTTP/2
    /// GOAWAY: streams open go on, no new ones). `/held` answers once `release` is notified, after notifying
    /// `held`.
    struct Server {
        base: Uri,
        ca_pem: String,
        accepted: Arc<AtomicUsize>,
        /// Connections open now.
        live: Arc<watch::Sender<usize>>,
        kill: Arc<Notify>,
        goaway: Arc<Notify>,
        held: Arc<Notify>,
        release: Arc<Notify>,
    }

    impl Server {
        async fn start(alpn: &[&[u8]]) -> Result<Server> {
            let ca = Ca::new("upstream test CA")?;
            let served = ca.issue_server(&["127.0.0.1".to_string()])?;
            let mut config =
                (*certs::server_config(vec![served.cert_der()], served.key_der())?).clone();
            config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
            let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
            let listener = TcpListener::bind("127.0.0.1:0").await?;
            let addr = listener.local_addr()?;
            let (accepted, live) = (
                Arc::new(AtomicUsize::new(0)),
                Arc::new(watch::Sender::new(0)),
            );
            let (kill, goaway, held, release) = (
                Arc::new(Notify::new()),
                Arc::new(Notify::new()),
                Arc::new(Notify::new()),
                Arc::new(Notify::new()),
            );
            tokio::spawn({
                let (accepted, live) = (accepted.clone(), live.clone());
                let (kill, goaway, held, release) =
                    (kill.clone(), goaway.clone(), held.clone(), release.clone());
                async move {
                    while let Ok((tcp, _)) = listener.accept().await {
                        accepted.fetch_add(1, Ordering::SeqCst);
                        live.send_modify(|n| *n += 1);
                        let (acceptor, live) = (acceptor.clone(), live.clone());
                        let (kill, goaway, held, release) =
                            (kill.clone(), goaway.clone(), held.clone(), release.clone());
                        tokio::spawn(async move {
                            let killed = kill.notified();
                            tokio::pin!(killed);
                            killed.as_mut().enable();
                            let going = goaway.notified();
                            tokio::pin!(going);
                            going.as_mut().enable();
                            if let Ok(tls) = acceptor.accept(tcp).await {
                                let service =
                                    hyper::service::service_fn(move |req: Request<Incoming>| {
                                        let (held, release) = (held.clone(), release.clone());
                                        async move {
                                            if req.uri().path() == "/held" {
                                                held.notify_one();
                                                release.notified().await;
                                            }
                                            let version = format!("{:?}", req.version());
                                            Ok::<_, std::convert::Infallible>(Response::new(
                                                http_body_util::Full::new(bytes::Bytes::from(
                                                    version,
                                                )),
                                            ))
                                        }
                                    });
                                let builder = hyper_util::server::conn::auto::Builder::new(
                                    TokioExecutor::new(),
                                );
                                let served = builder.serve_connection(TokioIo::new(tls), service);
                                tokio::pin!(served);
                                tokio::select! {
                                    _ = served.as_mut() => {}
                                    () = killed.as_mut() => {}
                                    () = going => {
                                        served.as_mut().graceful_shutdown();
                                        tokio::select! {
                                            _ = served.as_mut() => {}
                                            () = killed => {}
                                        }
                                    }
                                }
                            }
                            live.send_modify(|n| *n -= 1);
                        });
                    }
                }
            });
            Ok(Server {
                base: format!("https://{addr}/").parse()?,
                ca_pem: ca.cert_pem().to_string(),
                accepted,
                live,
                kill,
                goaway,
                held,
                release,
            })
        }

        fn settings(&self, idle: Duration) -> Result<Arc<Settings>> {
            settings_for(&self.base, &self.ca_pem, idle, Duration::from_secs(5))
        }

        async fn until_closed(&self) -> Result<()> {
            let mut live = self.live.subscribe();
            tokio::time::timeout(Duration::from_secs(20), live.wait_for(|n| *n == 0))
                .await
                .context("the server's connections stay open")??;
            Ok(())
        }
    }

    /// Settings for a pool of connections to `base`, trusting `ca_pem`.
    fn settings_for(
        base: &Uri,
        ca_pem: &str,
        idle: Duration,
        connect_timeout: Duration,
    ) -> Result<Arc<Settings>> {
        let tls = (*certs::client_config(ca_pem.as_bytes(), &[])?).clone();
        let connector = |http2: bool| {
            let builder = hyper_rustls::HttpsConnectorBuilder::new()
                .with_tls_config(tls.clone())
                .https_or_http();
            let mut http = HttpConnector::new();
            http.enforce_http(false);
            TimeoutConnector {
                inner: if http2 {
                    builder.enable_http1().enable_http2().wrap_connector(http)
                } else {
                    builder.enable_http1().wrap_connector(http)
                },
                timeout: connect_timeout,
            }
        };
        let http1 = connector(false);
        let http2 = Http2 {
            connect_timeout,
            stream_window: 256 * 1024,
            connection_window: 1024 * 1024,
            idle,
        };
        Ok(Arc::new(Settings::new(
            base.clone(),
            connector(true),
            http2,
            move || Client::builder(TokioExecutor::new()).build(http1.clone()),
        )))
    }

    /// The version the server saw, read from the body of a GET sent on `conn`.
    async fn get(conn: &Conn, server: &Server) -> Result<String> {
        get_path(conn, &server.base, "x").await
    }

    /// The body of a GET of `path` under `base`, sent on `conn`.
    async fn get_path(conn: &Conn, base: &Uri, path: &str) -> Result<String> {
        let req = Request::get(format!("{base}{path}")).body(ReqBody::Empty)?;
        let body = conn
            .send(req)
            .await?
            .into_body()
            .collect()
            .await?
            .to_bytes();
        Ok(String::from_utf8(body.to_vec())?)
    }

    #[tokio::test]
    async fn requests_share_one_http2_connection_and_a_closed_one_is_made_again() -> Result<()> {
        let server = Server::start(&[b"h2", b"http/1.1"]).await?;
        let conn = Arc::new(Conn::new(
            server.settings(Duration::from_secs(90))?,
            Arc::default(),
        ));
        assert_eq!(get(&conn, &server).await?, "HTTP/2.0");
        let together = (0..16).map(|_| {
            let conn = conn.clone();
            let base = server.base.clone();
            tokio::spawn(async move { get_path(&conn, &base, "y").await })
        });
        for done in futures_util::future::join_all(together).await {
            done??;
        }
        assert_eq!(server.accepted.load(Ordering::SeqCst), 1);

        server.kill.notify_waiters();
        server.until_closed().await?;
        assert_eq!(get(&conn, &server).await?, "HTTP/2.0");
        assert_eq!(server.accepted.load(Ordering::SeqCst), 2);
        Ok(())
    }

    /// The apiserver shuts a connection down gracefully (GOAWAY, as kube-apiserver's `--goaway-chance` does to
    /// rebalance): the request open on it is answered, and the next one goes out on a new connection.
    #[tokio::test]
    async fn a_goaway_lets_the_open_request_finish_and_the_next_one_reconnects() -> Result<()> {
        let server = Server::start(&[b"h2"]).await?;
        let conn = Arc::new(Conn::new(
            server.settings(Duration::from_secs(90))?,
            Arc::default(),
        ));
        let held = tokio::spawn({
            let (conn, base) = (conn.clone(), server.base.clone());
            async move { get_path(&conn, &base, "held").await }
        });
        tokio::time::timeout(Duration::from_secs(20), server.held.notified())
            .await
            .context("the held request never reached the server")?;
        server.goaway.notify_waiters();
        server.release.notify_one();
        assert_eq!(held.await??, "HTTP/2.0");
        server.until_closed().await?;
        assert_eq!(get(&conn, &server).await?, "HTTP/2.0");
        assert_eq!(server.accepted.load(Ordering::SeqCst), 2);
        Ok(())
    }

    #[tokio::test]
    async fn a_connection_is_closed_once_idle_and_never_while_a_request_is_open() -> Result<()> {
        let server = Server::start(&[b"h2"]).await?;
        let open = Arc::new(AtomicUsize::new(1));
        let conn = Conn::new(server.settings(Duration::from_millis(200))?, open.clone());
        get(&conn, &server).await?;
        // A request still open (its body not finished): the connection stays through five idle periods. On
        // the paused clock the idle checks run as the clock advances, with no wait (and the connection would be
        // gone from the slot after one period: the checks take its sender first).
        tokio::time::pause();
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        tokio::time::resume();
        assert!(
            conn.state.sender().is_some(),
            "the slot dropped a connection in use"
        );
        assert_eq!(*server.live.borrow(), 1);
        open.store(0, Ordering::SeqCst);
        server.until_closed().await?;
        assert_eq!(get(&conn, &server).await?, "HTTP/2.0");
        assert_eq!(server.accepted.load(Ordering::SeqCst), 2);
        Ok(())
    }

    #[tokio::test]
    async fn an_apiserver_without_http2_is_spoken_to_in_http1() -> Result<()> {
        let server = Server::start(&[b"http/1.1"]).await?;
        let settings = server.settings(Duration::from_secs(90))?;
        let conn = Conn::new(settings.clone(), Arc::default());
        assert_eq!(get(&conn, &server).await?, "HTTP/1.1");
        assert!(settings.speaks_http1());
        // Another slot of the same pool goes straight to HTTP/1.1 (no probing connection of its own).
        let accepted = server.accepted.load(Ordering::SeqCst);
        let other = Conn::new(settings, Arc::default());
        assert_eq!(get(&other, &server).await?, "HTTP/1.1");
        assert_eq!(server.accepted.load(Ordering::SeqCst), accepted + 1);
        Ok(())
    }

    #[tokio::test]
    async fn a_refused_connect_is_a_connect_error() -> Result<()> {
        let server = Server::start(&[b"h2"]).await?;
        let unused = TcpListener::bind("127.0.0.1:0").await?;
        let base: Uri = format!("https://{}/", unused.local_addr()?).parse()?;
        drop(unused);
        let settings = settings_for(
            &base,
            &server.ca_pem,
            Duration::from_secs(90),
            Duration::from_secs(5),
        )?;
        let conn = Conn::new(settings, Arc::default());
        let req = Request::get(format!("{base}x")).body(ReqBody::Empty)?;
        match conn.send(req).await {
            Err(e) => assert!(e.is_connect(), "{e}"),
            Ok(response) => bail!("answered {}", response.status()),
        }
        Ok(())
    }

    /// An apiserver that takes TCP connections and never answers the TLS handshake: requests that queued behind
    /// the one connect get its timeout (one connection tried, not one each in turn), and the timeout stays
    /// recognisable (a 504, not a 502).
    #[tokio::test]
    async fn requests_waiting_for_a_connect_that_times_out_share_its_failure() -> Result<()> {
        let server = Server::start(&[b"h2"]).await?;
        let silent = TcpListener::bind("127.0.0.1:0").await?;
        let base: Uri = format!("https://{}/", silent.local_addr()?).parse()?;
        let accepted = Arc::new(AtomicUsize::new(0));
        tokio::spawn({
            let accepted = accepted.clone();
            async move {
                let mut held = Vec::new();
                while let Ok((tcp, _)) = silent.accept().await {
                    accepted.fetch_add(1, Ordering::SeqCst);
                    held.push(tcp);
                }
            }
        });
        let settings = settings_for(
            &base,
            &server.ca_pem,
            Duration::from_secs(90),
            Duration::from_millis(300),
        )?;
        let conn = Arc::new(Conn::new(settings, Arc::default()));
        let sends = (0..4).map(|_| {
            let (conn, base) = (conn.clone(), base.clone());
            tokio::spawn(async move {
                let req = Request::get(format!("{base}x")).body(ReqBody::Empty)?;
                match conn.send(req).await {
                    Err(e) => anyhow::Ok(e),
                    Ok(response) => bail!("answered {}", response.status()),
                }
            })
        });
        for sent in futures_util::future::join_all(sends).await {
            let e = sent??;
            assert!(e.is_connect(), "{e}");
            assert!(
                crate::chain_has::<ConnectTimedOut>(&e),
                "{}",
                crate::error_chain(&e)
            );
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        Ok(())
    }
}

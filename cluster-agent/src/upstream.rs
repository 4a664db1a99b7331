//! One pooled connection to the apiserver ([`crate::pool`] keeps several).
//!
//! When the apiserver speaks HTTP/2 (ALPN `h2`, as kube-apiserver does over TLS), a slot is one HTTP/2
//! connection of the `h2` crate (hyper's own HTTP/2), used directly: the request's task opens the stream and
//! awaits the response head itself, woken by the connection's task when it arrives. hyper's client in front of
//! `h2` added a hand-off per request to the connection's dispatch task over a channel, a task spawned per
//! request to await the head, and a channel back to the caller (docs/BENCHMARKS.md, nineteenth pass); before
//! that, hyper-util's legacy client added a pool checkout keyed by host, a boxed lazy connect and URI rewriting
//! (seventh pass). An apiserver that speaks only HTTP/1.1, or an `http://` URL, gets hyper-util's client
//! instead, whose keep-alive connections carry one request at a time.
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
use http::{HeaderMap, Method, Request, Response, Uri, header};
use http_body::{Body as _, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connection as _, HttpConnector};
use hyper_util::rt::TokioIo;
use tether_runtime::serve::BoxError;
use tether_tunnel::cork::Corked;
use tether_tunnel::heads::{BodyReader, ReadChunk};
use tower::ServiceExt as _;

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

/// The body of a response from the apiserver: an HTTP/2 stream's, or hyper-util's (HTTP/1.1).
pub(crate) enum RespBody {
    /// The receiving half of an HTTP/2 stream.
    H2(H2Body),
    /// From hyper-util's HTTP/1.1 client.
    Http1(Incoming),
}

impl http_body::Body for RespBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            RespBody::H2(b) => b.poll_frame(cx),
            RespBody::Http1(b) => Pin::new(b).poll_frame(cx).map_err(Into::into),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RespBody::H2(b) => b.recv.is_end_stream(),
            RespBody::Http1(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RespBody::H2(b) => b
                .remaining
                .map_or_else(SizeHint::default, SizeHint::with_exact),
            RespBody::Http1(b) => b.size_hint(),
        }
    }
}

/// An HTTP/2 response body. Each DATA frame's bytes are given back to the stream's receive window as they are
/// handed on (the reader's pace is the apiserver's), and its `Content-Length`, which `h2` enforces, is the size
/// hint.
pub(crate) struct H2Body {
    recv: h2::RecvStream,
    /// Bytes still to come by the `Content-Length`, if it had one.
    remaining: Option<u64>,
    /// All DATA read; trailers (if any) are next.
    data_done: bool,
}

impl H2Body {
    fn new(recv: h2::RecvStream, headers: &HeaderMap) -> Self {
        let remaining = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        Self {
            recv,
            remaining,
            data_done: false,
        }
    }

    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if !self.data_done {
            match std::task::ready!(self.recv.poll_data(cx)) {
                Some(Ok(data)) => {
                    // Errors only once the stream is gone, which the next poll reports.
                    let _ = self.recv.flow_control().release_capacity(data.len());
                    if let Some(remaining) = &mut self.remaining {
                        *remaining = remaining.saturating_sub(data.len() as u64);
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Some(Err(e)) => return Poll::Ready(Some(Err(e.into()))),
                None => self.data_done = true,
            }
        }
        match std::task::ready!(self.recv.poll_trailers(cx)) {
            Ok(Some(trailers)) => Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
            Ok(None) => Poll::Ready(None),
            Err(e) => Poll::Ready(Some(Err(e.into()))),
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
    Request(h2::Error),
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
    send: h2::client::SendRequest<Bytes>,
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

    /// Sends `req` (an absolute URI naming the apiserver, hop-by-hop headers already removed) and waits for
    /// the response head.
    pub(crate) async fn send(
        &self,
        req: Request<ReqBody>,
    ) -> Result<Response<RespBody>, SendError> {
        if self.settings.speaks_http1() {
            return Box::pin(self.send_http1(req)).await;
        }
        let (mut head, mut body) = req.into_parts();
        if let Some(len) = body.size_hint().exact()
            && (len != 0 || !matches!(head.method, Method::GET | Method::HEAD | Method::DELETE))
        {
            head.headers
                .entry(header::CONTENT_LENGTH)
                .or_insert_with(|| http::HeaderValue::from(len));
        }
        let mut fresh = false;
        loop {
            // A handle of the live connection's, taken under the lock; the request goes out after it.
            let live = {
                let sender = self.state.sender();
                sender.as_ref().map(|live| (live.send.clone(), live.id))
            };
            let Some((mut send, id)) = live else {
                // Boxed: connecting is rare, and its state (connector, TLS and HTTP/2 handshakes) would
                // otherwise make every request's future, which is moved around, that much larger.
                if !Box::pin(self.connect()).await? {
                    let req = Request::from_parts(head, body);
                    return Box::pin(self.send_http1(req)).await;
                }
                fresh = true;
                continue;
            };
            // Fails once the connection has failed or the apiserver sent GOAWAY: no new stream may open on it,
            // and the request, not sent yet, goes once more on a new connection (unless this one was new).
            if let Err(e) = std::future::poll_fn(|cx| send.poll_ready(cx)).await {
                forget(&mut self.state.sender(), id);
                if fresh {
                    return Err(SendError::Request(e));
                }
                tracing::debug!(error = %e, "upstream connection closed before a request was sent; sending it again");
                fresh = true;
                continue;
            }
            self.state.sent.fetch_add(1, Ordering::Relaxed);
            let eos = body.is_end_stream();
            // A connection can die unnoticed (the apiserver restarted, something between dropped it) until its
            // task reads the end, and a request sent on it meanwhile fails with it. One that may be sent twice
            // (no body, a method without side effects) keeps a copy of its head to go once more on a new
            // connection, as Go's HTTP/2 transport does; others fail (502) rather than risk running twice.
            let replay = (!fresh
                && eos
                && matches!(head.method, Method::GET | Method::HEAD | Method::OPTIONS))
            .then(|| copy_head(&head));
            let answered = match send.send_request(Request::from_parts(head, ()), eos) {
                Ok((response, tx)) => {
                    if !eos {
                        tokio::spawn(send_body(body, tx));
                    }
                    response.await
                }
                Err(e) => Err(e),
            };
            let e = match answered {
                Ok(response) => {
                    let (parts, recv) = response.into_parts();
                    let body = RespBody::H2(H2Body::new(recv, &parts.headers));
                    return Ok(Response::from_parts(parts, body));
                }
                Err(e) => e,
            };
            // The connection failed (not just this stream): the next request makes a new one.
            if e.is_io() || e.is_go_away() {
                forget(&mut self.state.sender(), id);
                if let Some(copy) = replay {
                    tracing::debug!(error = %e, "upstream connection failed under a request that can be sent again; sending it on a new one");
                    head = copy;
                    body = ReqBody::Empty;
                    fresh = true;
                    continue;
                }
            }
            return Err(SendError::Request(e));
        }
    }

    async fn send_http1(&self, req: Request<ReqBody>) -> Result<Response<RespBody>, SendError> {
        self.state.sent.fetch_add(1, Ordering::Relaxed);
        let client = self.state.legacy.get_or_init(|| (self.settings.legacy)());
        let response = client.request(req).await.map_err(SendError::Legacy)?;
        Ok(response.map(RespBody::Http1))
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
        if self.state.sender().is_some() {
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
        // hyper's defaults for its HTTP/2 client, which this connection replaces. Writes are gathered: requests
        // whose tasks were woken together (one read from the tunnel) leave in one TLS record and syscall.
        let handshake = h2::client::Builder::new()
            .initial_window_size(settings.http2.stream_window)
            .initial_connection_window_size(settings.http2.connection_window)
            .initial_max_send_streams(100)
            .max_frame_size(16 * 1024)
            .max_header_list_size(16 * 1024)
            .max_send_buffer_size(1024 * 1024)
            .max_local_error_reset_streams(Some(1024))
            .enable_push(false)
            .handshake::<_, Bytes>(Corked::new(TokioIo::new(io)));
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

/// A copy of a request's head (without its extensions, which HTTP/2 does not send).
fn copy_head(head: &http::request::Parts) -> http::request::Parts {
    let (mut copy, ()) = Request::new(()).into_parts();
    copy.method = head.method.clone();
    copy.uri = head.uri.clone();
    copy.version = head.version;
    copy.headers = head.headers.clone();
    copy
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
    connection: h2::client::Connection<IO, Bytes>,
    state: Weak<State>,
    open: Arc<AtomicUsize>,
    id: u64,
    idle: Duration,
) where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
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

/// Sends a request's body on its HTTP/2 stream as the stream's send window allows, in a task of its own (the
/// request's task awaits the response head meanwhile, which may come first). A body that fails resets the
/// stream, so the apiserver does not take a truncated body for a whole one; a stream the apiserver reset
/// stops it.
async fn send_body(mut body: ReqBody, mut tx: h2::SendStream<Bytes>) {
    enum Next {
        Frame(Option<Result<Frame<Bytes>, BoxError>>),
        Reset,
    }
    loop {
        let next = std::future::poll_fn(|cx| {
            if tx.poll_reset(cx).is_ready() {
                return Poll::Ready(Next::Reset);
            }
            Pin::new(&mut body).poll_frame(cx).map(Next::Frame)
        })
        .await;
        let frame = match next {
            Next::Reset => return,
            Next::Frame(None) => {
                let _ = tx.send_data(Bytes::new(), true);
                return;
            }
            Next::Frame(Some(Err(e))) => {
                tracing::debug!(error = %e, "a request body failed; resetting its upstream stream");
                tx.send_reset(h2::Reason::CANCEL);
                return;
            }
            Next::Frame(Some(Ok(frame))) => frame,
        };
        let mut data = match frame.into_data() {
            Ok(data) => data,
            Err(frame) => {
                if let Ok(trailers) = frame.into_trailers() {
                    let _ = tx.send_trailers(trailers);
                } else {
                    let _ = tx.send_data(Bytes::new(), true);
                }
                return;
            }
        };
        while !data.is_empty() {
            tx.reserve_capacity(data.len());
            match std::future::poll_fn(|cx| tx.poll_capacity(cx)).await {
                Some(Ok(0)) => continue,
                Some(Ok(room)) => {
                    let chunk = data.split_to(room.min(data.len()));
                    let last = data.is_empty() && body.is_end_stream();
                    if tx.send_data(chunk, last).is_err() {
                        return;
                    }
                    if last {
                        return;
                    }
                }
                // The stream or the connection is gone.
                Some(Err(_)) | None => return,
            }
        }
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
            .await
            .map_err(|e| anyhow::anyhow!(e))?
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
    /// A connection that dies under a request the apiserver has taken up: a POST fails with it (sent again, it
    /// could run twice); a GET, which may be sent twice, goes once more on a new connection.
    #[tokio::test]
    async fn a_dead_connection_resends_only_what_may_be_sent_twice() -> Result<()> {
        let server = Server::start(&[b"h2"]).await?;
        let conn = Arc::new(Conn::new(
            server.settings(Duration::from_secs(90))?,
            Arc::default(),
        ));
        let held = |method: Method| {
            let conn = conn.clone();
            let uri = format!("{}held", server.base);
            tokio::spawn(async move {
                let req = Request::builder()
                    .method(method)
                    .uri(uri)
                    .body(ReqBody::Empty)?;
                anyhow::Ok(conn.send(req).await?.status())
            })
        };
        let accepted = || server.accepted.load(Ordering::SeqCst);

        assert_eq!(get(&conn, &server).await?, "HTTP/2.0");
        let post = held(Method::POST);
        server.held.notified().await;
        server.kill.notify_waiters();
        let failed = tokio::time::timeout(Duration::from_secs(10), post).await??;
        assert!(failed.is_err(), "the POST must fail with its connection");
        assert_eq!(accepted(), 1, "the POST was sent once");

        assert_eq!(get(&conn, &server).await?, "HTTP/2.0");
        assert_eq!(accepted(), 2);
        let again = held(Method::GET);
        server.held.notified().await;
        server.kill.notify_waiters();
        tokio::time::timeout(Duration::from_secs(10), server.held.notified()).await?;
        assert_eq!(accepted(), 3, "the GET went once more, on a new connection");
        server.release.notify_one();
        let status = tokio::time::timeout(Duration::from_secs(10), again).await???;
        assert_eq!(status, http::StatusCode::OK);
        Ok(())
    }

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

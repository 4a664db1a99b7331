//! The one TLS + HTTP accept loop every Tether server uses: TLS (ALPN `h2` and `http/1.1` as the
//! `rustls::ServerConfig` says), HTTP/1.1 or HTTP/2 per connection (hyper-util's `auto` builder), upgrades
//! (WebSocket, `101` pipes), the client certificate handed to the service, connection budgets (one for
//! connections without a client certificate, optionally one of their own for those with one, a bound on
//! connections still in their TLS handshake, per-source-IP bounds), a TLS-handshake, header-read and idle
//! timeout, and a graceful shutdown in two steps the caller drives ([`Draining`]).
//!
//! The phases of a connection and what bounds each:
//!
//! ```text
//!  backlog ──accept──▶ handshaking ──TLS done──▶ served ──▶ closed
//!  (waits while        (max_connections_per_ip,  (max_connections, or cert_budget for a client that
//!   max_handshakes      else closed at accept;    presented a certificate; full → closed at once;
//!   are in use)         max_handshakes_per_ip,    idle_timeout with no request in flight → closed
//!                       else waits its turn;      (HTTP/1.1) or GOAWAY (HTTP/2))
//!                       tls_handshake_timeout)
//! ```
//!
//! With [`serve_on`] and [`Sharding`], a connection is given the shard ([`crate::shards`]) with the fewest TLS
//! handshakes in progress. When that shard has none, the handshake runs there; otherwise (a burst of connects)
//! it runs on the accept loop's workers, which take whatever is ready, and the connection moves to its shard
//! afterwards. Past its handshake and admission it is read up to its first request's target (bounded in bytes
//! and by the header-read timeout); when the caller's placement names another shard it moves there, with what
//! was read put back in front, and otherwise it stays on the shard it was given.
//!
//! Not done here: anything that needs to know who the client is beyond its address and certificate (per
//! principal bounds are the service's).
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

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::service::Service;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use rustls::pki_types::CertificateDer;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::shards::{Placement, Shards};

/// Errors a service or body may return.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The limits of one listener.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Most concurrent connections past their TLS handshake that presented no client certificate (all of them
    /// when [`Limits::cert_budget`] is `None`); past it a new one is closed right after its handshake. Taken as
    /// at least 1 and at most `tokio::sync::Semaphore::MAX_PERMITS` (`usize::MAX` means no limit).
    pub max_connections: usize,
    /// A budget of their own for connections whose client presented a (verified) certificate, e.g. the
    /// relay's agent tunnels, so that connections without one cannot take it; `None`: they share
    /// [`Limits::max_connections`].
    pub cert_budget: Option<usize>,
    /// Most connections in their TLS handshake at once; past it new connections wait in the kernel's backlog.
    pub max_handshakes: usize,
    /// Most connections of one source IP in their TLS handshake at once; past it new ones from that address
    /// wait their turn (within [`Limits::tls_handshake_timeout`]) without holding one of the
    /// [`Limits::max_handshakes`] slots.
    pub max_handshakes_per_ip: usize,
    /// Most connections of one source IP at once (in their handshake, or served without a client certificate
    /// when [`Limits::cert_budget`] is set); past it new ones are closed at accept.
    pub max_connections_per_ip: usize,
    /// How long a client has to finish the TLS handshake.
    pub tls_handshake_timeout: Duration,
    /// How long an HTTP/1.1 client has to send a request's headers.
    pub header_read_timeout: Duration,
    /// A connection with no request in flight (no response being produced or streamed) for this long is
    /// closed: HTTP/1.1 between keep-alive requests, HTTP/2 with no open stream (GOAWAY). `None`: never.
    /// Upgraded connections (WebSocket, tunnels) are not HTTP any more and are not affected.
    pub idle_timeout: Option<Duration>,
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
            cert_budget: None,
            max_handshakes: 1_024,
            max_handshakes_per_ip: usize::MAX,
            max_connections_per_ip: usize::MAX,
            tls_handshake_timeout: Duration::from_secs(10),
            header_read_timeout: Duration::from_secs(30),
            idle_timeout: None,
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
    /// The connection's slot under [`Limits::max_connections`] (or [`Limits::cert_budget`]), held by the accept
    /// loop until the HTTP connection ends; keep a clone for as long as anything (an upgraded pipe, a tunnel) still uses it after that, so the
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
    S::Error: Into<BoxError> + 'static,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    serve_on(listener, tls, limits, make_service, None, shutdown).await
}

/// [`serve`], with each connection served on one of `sharding`'s shards: its TLS handshake runs on the next in
/// turn, and it moves once to the one its first request's target is placed on (see [`Sharding`]), if another.
/// The accept loop runs where this is called. `None`: every connection is served where this is called.
pub async fn serve_on<M, S, B>(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    limits: Limits,
    make_service: M,
    sharding: Option<Sharding>,
    shutdown: impl Future<Output = ()>,
) -> Draining
where
    M: Fn(Conn) -> S + Send + Sync + 'static,
    S: Service<hyper::Request<Incoming>, Response = hyper::Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError> + 'static,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let make_service = Arc::new(make_service);
    let acceptor = TlsAcceptor::from(tls);
    let handshakes = Arc::new(Semaphore::new(
        limits.max_handshakes.clamp(1, Semaphore::MAX_PERMITS),
    ));
    let budgets = Arc::new(Budgets {
        plain: Arc::new(Semaphore::new(
            limits.max_connections.clamp(1, Semaphore::MAX_PERMITS),
        )),
        cert: limits
            .cert_budget
            .map(|n| Arc::new(Semaphore::new(n.clamp(1, Semaphore::MAX_PERMITS)))),
        per_ip: PerIp::new(limits.max_handshakes_per_ip, limits.max_connections_per_ip),
    });
    let draining = Draining {
        connections: TaskTracker::new(),
        graceful: CancellationToken::new(),
        hard: CancellationToken::new(),
    };
    let setup = Setup {
        acceptor,
        limits: Arc::new(limits),
        make_service,
        sharding,
        connections: draining.connections.clone(),
        graceful: draining.graceful.clone(),
        hard: draining.hard.clone(),
    };
    tokio::pin!(shutdown);
    loop {
        let handshake = tokio::select! {
            () = &mut shutdown => break,
            permit = handshakes.clone().acquire_owned() => match permit {
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
        let Some(ip_slot) = budgets.per_ip.admit(peer.ip()) else {
            // Dropping the stream closes it: this address holds its bound of connections already.
            tracing::debug!(%peer, "connection refused at accept: this address is at its bound");
            continue;
        };
        let _ = tcp.set_nodelay(true);
        // Its address's handshake slot is taken here, in the order the connections were accepted, whatever
        // thread then runs each one's handshake; without one, it waits for its address's turn
        // (`serve_connection`).
        let ip_handshake = ip_slot.handshakes.clone().try_acquire_owned().ok();
        let admission = Admission {
            handshake,
            ip_handshake,
            handshakes: handshakes.clone(),
            ip_slot,
            budgets: budgets.clone(),
        };
        match &setup.sharding {
            // Sharded, a connection is served on the shard with the fewest handshakes in progress, and moves
            // only when its first request names another shard (`serve_connection`). Its handshake runs there
            // too when that shard has none in progress: handshaking on one thread and serving on another costs
            // each open connection memory (docs/BENCHMARKS.md, twenty-third pass). Under a burst of connects
            // the handshakes run on the workers instead: on the shards each would wait behind everything its
            // shard has queued, and the other threads could not take it (twenty-fourth pass).
            Some(sharding) => {
                let busy = sharding.shards.least_busy();
                let index = busy.index();
                if busy.ahead() < SHARD_HANDSHAKES {
                    let home = Home {
                        index,
                        busy: Some(busy),
                    };
                    let connection =
                        serve_connection(setup.clone(), tcp, peer, admission, Some(home));
                    drop(
                        sharding
                            .shards
                            .handle(index)
                            .spawn(draining.connections.track_future(connection)),
                    );
                } else {
                    // Every shard has a handshake in progress: this one runs on the workers, which take
                    // whatever is ready, and the connection moves to its shard afterwards.
                    drop(busy);
                    let home = Home { index, busy: None };
                    draining.connections.spawn(serve_connection(
                        setup.clone(),
                        tcp,
                        peer,
                        admission,
                        Some(home),
                    ));
                }
            }
            None => {
                draining.connections.spawn(serve_connection(
                    setup.clone(),
                    tcp,
                    peer,
                    admission,
                    None,
                ));
            }
        }
    }
    draining
}

/// The connection budgets of one listener.
struct Budgets {
    /// Connections without a client certificate (all of them without a `cert`).
    plain: Arc<Semaphore>,
    /// Connections with a client certificate, when they have a budget of their own.
    cert: Option<Arc<Semaphore>>,
    /// Counts per source IP.
    per_ip: Arc<PerIp>,
}

/// What an accepted connection holds until it is served (or refused).
struct Admission {
    /// Its slot among the connections in their handshake.
    handshake: OwnedSemaphorePermit,
    /// Its slot among its address's connections in their handshake, if one was free at accept.
    ip_handshake: Option<OwnedSemaphorePermit>,
    /// All handshake slots (to give its slot back while it waits for one of its address's).
    handshakes: Arc<Semaphore>,
    /// Its count under its address.
    ip_slot: IpSlot,
    budgets: Arc<Budgets>,
}

/// Connections per source IP, and each address's handshake slots.
#[derive(Debug)]
struct PerIp {
    max_handshakes: usize,
    max_connections: usize,
    counts: Mutex<HashMap<IpAddr, IpEntry>>,
}

#[derive(Debug)]
struct IpEntry {
    /// Connections counted under the address.
    connections: usize,
    /// Its handshake slots.
    handshakes: Arc<Semaphore>,
}

impl PerIp {
    fn new(max_handshakes: usize, max_connections: usize) -> Arc<Self> {
        Arc::new(Self {
            max_handshakes: max_handshakes.clamp(1, Semaphore::MAX_PERMITS),
            max_connections,
            counts: Mutex::default(),
        })
    }

    /// Counts a new connection from `ip`, or `None` when `ip` holds its bound of connections already.
    fn admit(self: &Arc<Self>, ip: IpAddr) -> Option<IpSlot> {
        let ip = ip.to_canonical();
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        let entry = counts.entry(ip).or_insert_with(|| IpEntry {
            connections: 0,
            handshakes: Arc::new(Semaphore::new(self.max_handshakes)),
        });
        if entry.connections >= self.max_connections {
            if entry.connections == 0 {
                counts.remove(&ip);
            }
            return None;
        }
        entry.connections += 1;
        Some(IpSlot {
            per_ip: self.clone(),
            handshakes: entry.handshakes.clone(),
            ip,
            counted: true,
        })
    }
}

/// One connection's count under its address; released on drop.
#[derive(Debug)]
struct IpSlot {
    per_ip: Arc<PerIp>,
    /// The address's handshake slots.
    handshakes: Arc<Semaphore>,
    ip: IpAddr,
    counted: bool,
}

impl IpSlot {
    /// Stops counting the connection under its address (a connection with a budget of its own).
    fn release(&mut self) {
        if !std::mem::take(&mut self.counted) {
            return;
        }
        let mut counts = self
            .per_ip
            .counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(entry) = counts.get_mut(&self.ip) {
            entry.connections = entry.connections.saturating_sub(1);
            if entry.connections == 0 {
                counts.remove(&self.ip);
            }
        }
    }
}

impl Drop for IpSlot {
    fn drop(&mut self) {
        self.release();
    }
}

/// When a connection last had nothing in flight, and how many requests it has in flight now.
#[derive(Debug)]
struct Activity {
    state: Mutex<(usize, Instant)>,
}

impl Activity {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new((0, Instant::now())),
        })
    }

    /// A request starts; it is in flight until the returned guard is dropped.
    fn begin(self: &Arc<Self>) -> Busy {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.0 += 1;
        Busy(self.clone())
    }

    /// Resolves once nothing has been in flight for `timeout`.
    async fn idle_for(&self, timeout: Duration) {
        // Bounded: each round sleeps at least until a moment `timeout` after the last check or the last end.
        loop {
            let wake = {
                let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
                let now = Instant::now();
                match *state {
                    (0, since) if now >= since + timeout => return,
                    (0, since) => since + timeout,
                    _ => now + timeout,
                }
            };
            tokio::time::sleep_until(wake).await;
        }
    }
}

/// One request in flight on a connection (its response body included).
#[derive(Debug)]
struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        let mut state = self.0.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.0 = state.0.saturating_sub(1);
        if state.0 == 0 {
            state.1 = Instant::now();
        }
    }
}

/// The caller's service, with every request counted in flight until its response body is done or dropped.
struct Tracked<S> {
    inner: S,
    activity: Arc<Activity>,
}

type TrackedFuture<B, E> =
    Pin<Box<dyn Future<Output = Result<hyper::Response<TrackedBody<B>>, E>> + Send>>;

impl<S, B> Service<hyper::Request<Incoming>> for Tracked<S>
where
    S: Service<hyper::Request<Incoming>, Response = hyper::Response<B>>,
    S::Future: Send + 'static,
    S::Error: 'static,
    B: Body + Send + 'static,
{
    type Response = hyper::Response<TrackedBody<B>>;
    type Error = S::Error;
    type Future = TrackedFuture<B, S::Error>;

    fn call(&self, req: hyper::Request<Incoming>) -> Self::Future {
        let busy = self.activity.begin();
        // Boxed on its own before it is awaited: a handler's future is large (the whole request's state
        // machine), and held by value in this block it was copied at each move on its way into hyper's
        // dispatcher — ~12k instructions of memcpy per request in the relay under callgrind (docs/BENCHMARKS.md).
        let response = Box::pin(self.inner.call(req));
        Box::pin(async move {
            let resp = response.await?;
            Ok(resp.map(|body| TrackedBody {
                body: Box::pin(body),
                _busy: busy,
            }))
        })
    }
}

/// A response body that keeps its request in flight until it is dropped.
struct TrackedBody<B> {
    body: Pin<Box<B>>,
    _busy: Busy,
}

impl<B: Body> Body for TrackedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        self.body.as_mut().poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// What every connection of one accept loop is served with.
struct Setup<M> {
    acceptor: TlsAcceptor,
    limits: Arc<Limits>,
    make_service: Arc<M>,
    sharding: Option<Sharding>,
    connections: TaskTracker,
    graceful: CancellationToken,
    hard: CancellationToken,
}

impl<M> Clone for Setup<M> {
    fn clone(&self) -> Self {
        Self {
            acceptor: self.acceptor.clone(),
            limits: self.limits.clone(),
            make_service: self.make_service.clone(),
            sharding: self.sharding.clone(),
            connections: self.connections.clone(),
            graceful: self.graceful.clone(),
            hard: self.hard.clone(),
        }
    }
}

/// Serves one accepted connection: its TLS handshake, its admission, then HTTP until it ends. `home` is the
/// shard this runs on, when sharded: the socket joins that shard's reactor before the handshake.
async fn serve_connection<M, S, B>(
    ctx: Setup<M>,
    tcp: TcpStream,
    peer: SocketAddr,
    admission: Admission,
    home: Option<Home>,
) where
    M: Fn(Conn) -> S + Send + Sync + 'static,
    S: Service<hyper::Request<Incoming>, Response = hyper::Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError> + 'static,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let Setup {
        acceptor,
        limits,
        make_service,
        sharding,
        connections,
        graceful,
        hard,
    } = ctx;
    let Admission {
        handshake,
        ip_handshake,
        handshakes,
        mut ip_slot,
        budgets,
    } = admission;
    // One deadline for waiting for the address's turn and for the handshake itself.
    let handshake_deadline = Instant::now() + limits.tls_handshake_timeout;
    let (home, busy) = match home {
        Some(h) => (Some(h.index), h.busy),
        None => (None, None),
    };
    // Counted among its shard's handshakes exactly when the handshake runs there.
    let on_shard = busy.is_some();
    let mut tcp = Movable(Some(tcp));
    if on_shard && let Err(e) = tcp.rehome() {
        tracing::debug!(%peer, error = %e, "could not move the connection to its shard");
        return;
    }
    let shake = async {
        // Its address's slot first; while the address's slots are all taken, the connection waits without a
        // global one, so one address's connections cannot hold the slots others need.
        let (handshake, ip_handshake) = match ip_handshake {
            Some(ip_handshake) => (handshake, ip_handshake),
            None => {
                drop(handshake);
                let ip_handshake = ip_slot.handshakes.clone().acquire_owned().await.ok()?;
                (handshakes.acquire_owned().await.ok()?, ip_handshake)
            }
        };
        let tls = acceptor.accept(tcp).await;
        drop((handshake, ip_handshake, busy));
        Some(tls)
    };
    let mut tls = tokio::select! {
        () = graceful.cancelled() => return,
        () = hard.cancelled() => return,
        r = tokio::time::timeout_at(handshake_deadline, shake) => match r {
            Ok(Some(Ok(tls))) => tls,
            Ok(Some(Err(e))) => {
                tracing::debug!(%peer, error = %e, "TLS handshake failed");
                return;
            }
            Ok(None) => return,
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
    // A client with a certificate takes from its own budget when there is one, and no longer counts under
    // its address (many agents may share one egress address with many users).
    let (budget, own_budget) = match (&client_cert, &budgets.cert) {
        (Some(_), Some(cert)) => (cert, true),
        _ => (&budgets.plain, false),
    };
    if own_budget {
        ip_slot.release();
    }
    let Ok(permit) = budget.clone().try_acquire_owned() else {
        tracing::debug!(%peer, with_certificate = own_budget, "connection refused: its budget is full");
        return;
    };
    let permit = Arc::new(permit);
    let service = make_service(Conn {
        peer,
        client_cert,
        permit: permit.clone(),
    });
    let admitted = Admitted {
        peer,
        service,
        limits,
        graceful,
        hard,
        _held: (permit, ip_slot),
    };
    let (Some(sharding), Some(home)) = (sharding, home) else {
        serve_http(tls, Bytes::new(), admitted).await;
        return;
    };
    // Sharded: read up to the first request's target, place the connection by it, and serve it there with
    // what was read put back in front. Whatever goes wrong here only loses the placement, never the
    // connection: hyper then answers (or ends) it as it would have.
    let mut read = BytesMut::new();
    let limits = &admitted.limits;
    let peeked = tokio::select! {
        () = admitted.hard.cancelled() => return,
        r = tokio::time::timeout(limits.header_read_timeout, first_target(&mut tls, &mut read, peek_limit(limits))) => r,
    };
    let target = match peeked {
        Ok(Ok(target)) => target,
        Ok(Err(e)) => {
            tracing::debug!(%peer, error = %e, "could not read the first request's target; placing the connection anywhere");
            None
        }
        // Nothing at all within the time a request's head has: closed, as HTTP/1.1 would close it.
        Err(_) if read.is_empty() => {
            tracing::debug!(%peer, "no request within the header-read timeout; closing");
            return;
        }
        Err(_) => None,
    };
    // What names no shard (a tunnel, a request for no cluster) stays where it was handshaken.
    let index = target
        .as_deref()
        .and_then(|target| (sharding.place)(target))
        .map_or(home, |index| index % sharding.shards.len());
    if index == home && on_shard {
        serve_http(tls, read.freeze(), admitted).await;
        return;
    }
    let served = connections.track_future(async move {
        let mut tls = tls;
        // Its socket now belongs to this shard's reactor.
        if let Err(e) = tls.get_mut().0.rehome() {
            tracing::debug!(%peer, error = %e, "could not move the connection to its shard");
            return;
        }
        serve_http(tls, read.freeze(), admitted).await;
    });
    sharding.shards.handle(index).spawn(served);
}

/// Handshakes in progress on the least busy shard from which the next connection is handshaken on the workers
/// instead of there (docs/BENCHMARKS.md, twenty-fourth pass: one keeps most of what handshaking on the shards
/// saves in memory, and a burst of connects comes up about as fast as with every handshake on the workers).
const SHARD_HANDSHAKES: usize = 1;

/// Where a sharded connection is to be served, and where its handshake runs.
struct Home {
    index: usize,
    /// Counted among its shard's handshakes until it is done, when the handshake runs on the shard (`None`: on
    /// the workers).
    busy: Option<crate::shards::Busy>,
}

/// A connection past its TLS handshake and its admission, and what serving it takes.
struct Admitted<S> {
    peer: SocketAddr,
    service: S,
    limits: Arc<Limits>,
    graceful: CancellationToken,
    hard: CancellationToken,
    /// Its slots, given back when it ends.
    _held: (Arc<OwnedSemaphorePermit>, IpSlot),
}

/// Serves HTTP on `tls`, with `prefix` (bytes already read from it) in front, until the connection ends.
async fn serve_http<S, B>(
    tls: tokio_rustls::server::TlsStream<Movable>,
    prefix: Bytes,
    admitted: Admitted<S>,
) where
    S: Service<hyper::Request<Incoming>, Response = hyper::Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError> + 'static,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let Admitted {
        peer,
        service,
        limits,
        graceful,
        hard,
        _held,
    } = admitted;
    let io = Rewind { prefix, inner: tls };
    let activity = Activity::new();
    let service = Tracked {
        inner: service,
        activity: activity.clone(),
    };

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
    let conn = builder.serve_connection_with_upgrades(TokioIo::new(io), service);
    tokio::pin!(conn);
    let idle = async {
        match limits.idle_timeout {
            Some(timeout) => activity.idle_for(timeout).await,
            None => std::future::pending().await,
        }
    };
    let result = tokio::select! {
        r = conn.as_mut() => r,
        () = graceful.cancelled() => {
            conn.as_mut().graceful_shutdown();
            tokio::select! {
                r = conn.as_mut() => r,
                () = hard.cancelled() => return,
            }
        }
        () = idle => {
            tracing::debug!(%peer, "closing an idle connection");
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

/// Shards to serve connections on, and where each goes (see [`crate::shards`]).
#[derive(Clone)]
pub struct Sharding {
    /// The shards.
    pub shards: Arc<Shards>,
    /// Where a connection goes, by its first request's target.
    pub place: Placement,
}

impl std::fmt::Debug for Sharding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sharding")
            .field("shards", &self.shards.len())
            .finish_non_exhaustive()
    }
}

/// The most bytes read from a connection to find its first request's target.
fn peek_limit(limits: &Limits) -> usize {
    // An HTTP/2 client's preface, SETTINGS and WINDOW_UPDATE come first; its HEADERS are compressed, so below
    // the header list's bound.
    limits.max_header_bytes.saturating_add(16 * 1024)
}

/// How long an HTTP/2 client has, after its preface, to send the first request that places its connection.
const H2_FIRST_REQUEST_WAIT: Duration = Duration::from_secs(1);

/// The HTTP/2 connection preface.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Reads from `tls` into `read` until the first request's target is known (HTTP/1.1: its request line;
/// HTTP/2, told by its preface: its first HEADERS, decoded by a throwaway `h2` server whose writes go nowhere).
/// `None` when the client closed first, or sent something neither would accept (hyper answers that).
async fn first_target(
    tls: &mut tokio_rustls::server::TlsStream<Movable>,
    read: &mut BytesMut,
    limit: usize,
) -> std::io::Result<Option<String>> {
    loop {
        // HTTP/2 as long as what was read agrees with the preface; placed once all of it is there.
        let seen = read.len().min(H2_PREFACE.len());
        let looks_h2 = seen > 0 && read[..seen] == H2_PREFACE[..seen];
        if looks_h2 && seen == H2_PREFACE.len() {
            return first_h2_target(tls, read, limit).await;
        }
        if !looks_h2 && let Some(end) = read.iter().position(|&b| b == b'\n') {
            return Ok(request_line_target(&read[..end]));
        }
        if read.len() >= limit {
            return Ok(None);
        }
        read.reserve(4096);
        if tls.read_buf(read).await? == 0 {
            return Ok(None);
        }
    }
}

/// The target of an HTTP/1.1 request line (`GET /path HTTP/1.1`, CR or not), when it has one.
fn request_line_target(line: &[u8]) -> Option<String> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let mut parts = line.split(|&b| b == b' ').filter(|p| !p.is_empty());
    let (_method, target, _version) = (parts.next()?, parts.next()?, parts.next()?);
    std::str::from_utf8(target).ok().map(str::to_owned)
}

async fn first_h2_target(
    tls: &mut tokio_rustls::server::TlsStream<Movable>,
    read: &mut BytesMut,
    limit: usize,
) -> std::io::Result<Option<String>> {
    let io = Recording {
        inner: tls,
        seen: read,
        replayed: 0,
        limit,
    };
    let mut builder = h2::server::Builder::new();
    builder.max_header_list_size(u32::try_from(limit).unwrap_or(u32::MAX));
    let mut conn = builder
        .handshake::<_, Bytes>(io)
        .await
        .map_err(std::io::Error::other)?;
    // Clients send their first request right after the preface; one that waits for the server's SETTINGS
    // (which this reader never sends) is placed anywhere after a moment instead.
    let Ok(first) = tokio::time::timeout(H2_FIRST_REQUEST_WAIT, conn.accept()).await else {
        return Ok(None);
    };
    match first {
        Some(Ok((request, _respond))) => Ok(request
            .uri()
            .path_and_query()
            .map(|p| p.as_str().to_owned())),
        Some(Err(e)) => Err(std::io::Error::other(e)),
        None => Ok(None),
    }
}

/// What a throwaway reader of a connection sees: first what was read already, then the connection, recording
/// everything it reads (up to `limit` bytes); what it writes is dropped.
struct Recording<'a> {
    inner: &'a mut tokio_rustls::server::TlsStream<Movable>,
    seen: &'a mut BytesMut,
    replayed: usize,
    limit: usize,
}

impl AsyncRead for Recording<'_> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if this.replayed < this.seen.len() {
            let n = buf.remaining().min(this.seen.len() - this.replayed);
            buf.put_slice(&this.seen[this.replayed..this.replayed + n]);
            this.replayed += n;
            return Poll::Ready(Ok(()));
        }
        if this.seen.len() >= this.limit {
            return Poll::Ready(Err(std::io::Error::other(
                "no request within the bytes read to place the connection",
            )));
        }
        let before = buf.filled().len();
        ready!(Pin::new(&mut *this.inner).poll_read(cx, buf))?;
        let new = &buf.filled()[before..];
        this.seen.extend_from_slice(new);
        this.replayed = this.seen.len();
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Recording<'_> {
    fn poll_write(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// A connection's socket, which can move to another runtime's reactor ([`Movable::rehome`]).
#[derive(Debug)]
struct Movable(Option<TcpStream>);

impl Movable {
    /// Registers the socket with the calling task's runtime instead of the one it was accepted on.
    fn rehome(&mut self) -> std::io::Result<()> {
        let tcp = self.0.take().ok_or_else(gone)?;
        self.0 = Some(TcpStream::from_std(tcp.into_std()?)?);
        Ok(())
    }

    fn tcp(self: Pin<&mut Self>) -> std::io::Result<Pin<&mut TcpStream>> {
        match &mut self.get_mut().0 {
            Some(tcp) => Ok(Pin::new(tcp)),
            None => Err(gone()),
        }
    }
}

fn gone() -> std::io::Error {
    std::io::Error::from(std::io::ErrorKind::NotConnected)
}

impl AsyncRead for Movable {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        self.tcp()?.poll_read(cx, buf)
    }
}

impl AsyncWrite for Movable {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.tcp()?.poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        self.tcp()?.poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.as_ref().is_some_and(TcpStream::is_write_vectored)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.tcp()?.poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.tcp()?.poll_shutdown(cx)
    }
}

/// A connection with bytes already read from it put back in front.
struct Rewind<T> {
    prefix: Bytes,
    inner: T,
}

impl<T: AsyncRead + Unpin> AsyncRead for Rewind<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = buf.remaining().min(self.prefix.len());
            buf.put_slice(&self.prefix.split_to(n));
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Rewind<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use tokio::io::AsyncWriteExt as _;

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

    /// One `GET PATH` on a new HTTP/1.1 connection that the server closes after it: the whole answer.
    async fn get_once(addr: SocketAddr, ca: &str, path: &str) -> anyhow::Result<String> {
        let mut stream = tls_client(addr, ca, b"http/1.1").await?;
        let request =
            format!("GET {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(60), stream.read_to_end(&mut answer)).await??;
        Ok(String::from_utf8_lossy(&answer).into_owned())
    }

    /// The shard the latest handshake ran on (`Some(None)`: off the shards), if there was one.
    fn last_handshake(handshakes: &Mutex<Vec<Option<usize>>>) -> Option<Option<usize>> {
        handshakes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .last()
            .copied()
    }

    /// The shard each TLS handshake ran on, in order: the certificate is chosen during the handshake, on the
    /// thread that runs it.
    #[derive(Debug)]
    struct HandshakeShards {
        inner: Arc<dyn rustls::server::ResolvesServerCert>,
        seen: Arc<Mutex<Vec<Option<usize>>>>,
    }

    impl rustls::server::ResolvesServerCert for HandshakeShards {
        fn resolve(
            &self,
            hello: rustls::server::ClientHello<'_>,
        ) -> Option<Arc<rustls::sign::CertifiedKey>> {
            self.seen
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(crate::shards::current());
            self.inner.resolve(hello)
        }
    }

    /// A sharded server on 127.0.0.1 whose answers name the shard that served them: `/zero…` goes to shard 0,
    /// `/one…` to shard 1, anything else nowhere in particular. Returns its address, its CA, the shards its
    /// handshakes ran on, and a stop switch.
    async fn sharded_server(
        limits: Limits,
    ) -> anyhow::Result<(
        SocketAddr,
        String,
        Arc<Mutex<Vec<Option<usize>>>>,
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<Draining>,
    )> {
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()])?;
        let cert_pem = cert.cert.pem();
        let tls = crate::tls::server_config(
            cert_pem.as_bytes(),
            cert.signing_key.serialize_pem().as_bytes(),
        )?;
        let handshakes = Arc::new(Mutex::new(Vec::new()));
        let mut config = (*tls).clone();
        config.cert_resolver = Arc::new(HandshakeShards {
            inner: config.cert_resolver.clone(),
            seen: handshakes.clone(),
        });
        let tls = Arc::new(config);
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shards = Shards::start(2, "serve-test")?;
        let sharding = Sharding {
            shards: shards.clone(),
            place: Arc::new(|target: &str| {
                if target.starts_with("/zero") {
                    Some(0)
                } else if target.starts_with("/one") {
                    Some(1)
                } else {
                    None
                }
            }),
        };
        let make = |_conn: Conn| {
            hyper::service::service_fn(|req: hyper::Request<Incoming>| async move {
                let answer = format!(
                    "{} on shard {:?}",
                    req.uri().path(),
                    crate::shards::current()
                );
                Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Full::new(
                    bytes::Bytes::from(answer),
                )))
            })
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve_on(
            listener,
            tls,
            limits,
            make,
            Some(sharding),
            async move {
                let _ = stopped.await;
            },
        ));
        // The shards stop with the server's last connection task (each holds the sharding, and with it them).
        drop(shards);
        Ok((addr, cert_pem, handshakes, stop, server))
    }

    async fn tls_client(
        addr: SocketAddr,
        ca: &str,
        alpn: &[u8],
    ) -> anyhow::Result<tokio_rustls::client::TlsStream<TcpStream>> {
        let client = crate::tls::client_config(Some(ca.as_bytes()), &[alpn])?;
        let tcp = TcpStream::connect(addr).await?;
        let name = rustls::pki_types::ServerName::try_from("localhost")?;
        Ok(tokio_rustls::TlsConnector::from(client)
            .connect(name, tcp)
            .await?)
    }

    #[tokio::test]
    async fn a_connection_is_served_on_the_shard_its_first_request_names() -> anyhow::Result<()> {
        let (addr, ca, _handshakes, stop, server) = sharded_server(Limits::default()).await?;
        for (first, shard) in [("/zero/a", 0), ("/one/a", 1)] {
            // HTTP/1.1, two requests written at once: both are read before the connection moves, and both
            // are answered on its shard, the second whatever it names.
            let mut stream = tls_client(addr, &ca, b"http/1.1").await?;
            let requests = format!(
                "GET {first} HTTP/1.1\r\nhost: localhost\r\n\r\nGET /elsewhere HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n"
            );
            stream.write_all(requests.as_bytes()).await?;
            let mut answer = Vec::new();
            tokio::time::timeout(Duration::from_secs(60), stream.read_to_end(&mut answer))
                .await??;
            let answer = String::from_utf8_lossy(&answer);
            assert!(
                answer.contains(&format!("{first} on shard Some({shard})"))
                    && answer.contains(&format!("/elsewhere on shard Some({shard})")),
                "{answer}"
            );

            // HTTP/2: the first HEADERS place the connection; every stream is served there.
            let stream = tls_client(addr, &ca, b"h2").await?;
            let (mut send, conn) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                    .await?;
            tokio::spawn(conn);
            for path in [first, "/elsewhere"] {
                let request = http::Request::builder()
                    .uri(format!("https://localhost{path}"))
                    .body(http_body_util::Empty::<bytes::Bytes>::new())?;
                let response = send.send_request(request).await?;
                let body = http_body_util::BodyExt::collect(response.into_body())
                    .await?
                    .to_bytes();
                assert_eq!(
                    String::from_utf8_lossy(&body),
                    format!("{path} on shard Some({shard})")
                );
            }
        }
        let _ = stop.send(());
        let draining = server.await?;
        assert!(draining.finish(Duration::from_secs(30)).await);
        Ok(())
    }

    #[tokio::test]
    async fn a_connection_is_handshaken_on_a_shard_and_stays_there_unless_its_request_names_another()
    -> anyhow::Result<()> {
        let (addr, ca, handshakes, stop, server) = sharded_server(Limits::default()).await?;
        let mut homes = Vec::new();
        for first in ["/elsewhere", "/elsewhere", "/zero", "/one", "/one", "/zero"] {
            let answer = get_once(addr, &ca, first).await?;
            let handshaken = last_handshake(&handshakes).flatten();
            // The handshake ran on a shard, not on the accept loop's runtime.
            let Some(home) = handshaken else {
                panic!("the handshake of {first} ran on no shard");
            };
            homes.push(home);
            let served = match first {
                "/zero" => 0,
                "/one" => 1,
                // A connection its first request places nowhere is served where it was handshaken.
                _ => home,
            };
            assert!(
                answer.ends_with(&format!("{first} on shard Some({served})")),
                "{first} handshaken on {home}: {answer}"
            );
        }
        // The handshakes take the shards in turn.
        assert!(homes.contains(&0) && homes.contains(&1), "{homes:?}");
        let _ = stop.send(());
        let draining = server.await?;
        assert!(draining.finish(Duration::from_secs(30)).await);
        Ok(())
    }

    /// Connections that hold a handshake open (a burst of connects, or a client that sends nothing) do not make
    /// the others wait behind them on the shards: while every shard has one in progress, the next connection is
    /// handshaken on the accept loop's runtime and still served on a shard.
    #[tokio::test]
    async fn while_every_shard_has_a_handshake_in_progress_the_next_runs_off_the_shards()
    -> anyhow::Result<()> {
        let (addr, ca, handshakes, stop, server) = sharded_server(Limits::default()).await?;
        // One connection in its handshake on each shard: accepted, and no ClientHello ever comes.
        let silent = [
            TcpStream::connect(addr).await?,
            TcpStream::connect(addr).await?,
        ];
        for first in ["/elsewhere", "/one", "/zero"] {
            let answer = get_once(addr, &ca, first).await?;
            assert_eq!(
                last_handshake(&handshakes),
                Some(None),
                "{first} was handshaken on a shard while both had a handshake in progress"
            );
            let served = match first {
                "/zero" => "Some(0)",
                "/one" => "Some(1)",
                _ => "Some(",
            };
            assert!(
                answer.contains(&format!("{first} on shard {served}")),
                "{first}: {answer}"
            );
        }
        // Once they are gone, handshakes run on the shards again.
        drop(silent);
        let give_up = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let answer = get_once(addr, &ca, "/elsewhere").await?;
            if let Some(Some(home)) = last_handshake(&handshakes) {
                assert!(
                    answer.ends_with(&format!("/elsewhere on shard Some({home})")),
                    "{answer}"
                );
                break;
            }
            assert!(
                tokio::time::Instant::now() < give_up,
                "the silent connections still count as handshakes in progress"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = stop.send(());
        let draining = server.await?;
        assert!(draining.finish(Duration::from_secs(30)).await);
        Ok(())
    }

    #[tokio::test]
    async fn what_cannot_be_placed_is_still_served_or_refused_as_without_shards()
    -> anyhow::Result<()> {
        let limits = Limits {
            max_header_bytes: 8192,
            header_read_timeout: Duration::from_secs(2),
            ..Limits::default()
        };
        let (addr, ca, _handshakes, stop, server) = sharded_server(limits).await?;

        // A request line longer than the bytes read to place it: placed anywhere, and hyper refuses the
        // oversized head as it would have.
        let mut stream = tls_client(addr, &ca, b"http/1.1").await?;
        let long = format!(
            "GET /zero/{} HTTP/1.1\r\nhost: localhost\r\n\r\n",
            "a".repeat(40_000)
        );
        let _ = stream.write_all(long.as_bytes()).await;
        let mut answer = Vec::new();
        let _ =
            tokio::time::timeout(Duration::from_secs(60), stream.read_to_end(&mut answer)).await?;
        let answer = String::from_utf8_lossy(&answer);
        assert!(
            answer.is_empty() || answer.starts_with("HTTP/1.1 431"),
            "{answer}"
        );

        // Not HTTP at all: the same.
        let mut stream = tls_client(addr, &ca, b"http/1.1").await?;
        stream.write_all(b"\x16\x03 not http\r\n\r\n").await?;
        let mut answer = Vec::new();
        let _ =
            tokio::time::timeout(Duration::from_secs(60), stream.read_to_end(&mut answer)).await?;
        let answer = String::from_utf8_lossy(&answer);
        assert!(
            answer.is_empty() || answer.starts_with("HTTP/1.1 400"),
            "{answer}"
        );

        // An HTTP/2 preface followed by garbage: the throwaway reader fails, hyper ends the connection.
        let mut stream = tls_client(addr, &ca, b"h2").await?;
        stream.write_all(H2_PREFACE).await?;
        stream.write_all(&[0xff; 64]).await?;
        let mut answer = Vec::new();
        let ended =
            tokio::time::timeout(Duration::from_secs(60), stream.read_to_end(&mut answer)).await;
        assert!(ended.is_ok(), "a garbled HTTP/2 connection was left open");
        assert!(
            !answer.windows(4).any(|w| w == b"HTTP"),
            "an HTTP/1.1 answer to an HTTP/2 client"
        );

        // An HTTP/2 client that waits for the server's SETTINGS before its first request gets them (from the
        // server that serves it, once it is placed anywhere): nothing waits on the other.
        let mut stream = tls_client(addr, &ca, b"h2").await?;
        stream.write_all(H2_PREFACE).await?;
        stream.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await?;
        let mut frame = [0u8; 9];
        tokio::time::timeout(Duration::from_secs(60), stream.read_exact(&mut frame)).await??;
        assert_eq!(
            frame[3], 4,
            "the server's first frame is its SETTINGS: {frame:?}"
        );
        drop(stream);

        // A client that says nothing after its handshake is closed once the header-read timeout passes.
        let mut stream = tls_client(addr, &ca, b"http/1.1").await?;
        let mut answer = Vec::new();
        let ended =
            tokio::time::timeout(Duration::from_secs(60), stream.read_to_end(&mut answer)).await;
        assert!(ended.is_ok(), "a silent connection was left open");

        // And the server still serves.
        let mut stream = tls_client(addr, &ca, b"http/1.1").await?;
        stream
            .write_all(b"GET /one HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n")
            .await?;
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(60), stream.read_to_end(&mut answer)).await??;
        assert!(
            String::from_utf8_lossy(&answer).ends_with("/one on shard Some(1)"),
            "{}",
            String::from_utf8_lossy(&answer)
        );
        let _ = stop.send(());
        let draining = server.await?;
        assert!(draining.finish(Duration::from_secs(30)).await);
        Ok(())
    }

    #[test]
    fn request_lines_give_their_target() {
        assert_eq!(
            request_line_target(b"GET /clusters/a/api?x=1 HTTP/1.1\r"),
            Some("/clusters/a/api?x=1".to_owned())
        );
        assert_eq!(
            request_line_target(b"GET /a HTTP/1.1"),
            Some("/a".to_owned())
        );
        assert_eq!(request_line_target(b"GET /a"), None);
        assert_eq!(request_line_target(b""), None);
        assert_eq!(request_line_target(b"GET \xff HTTP/1.1"), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_is_idle_only_once_its_last_request_ended_long_enough_ago() {
        let activity = Activity::new();
        let first = activity.begin();
        let second = activity.begin();
        let idle = activity.idle_for(Duration::from_secs(10));
        tokio::pin!(idle);
        // Virtual time: an hour passes with requests in flight, and the connection is not idle.
        assert!(
            tokio::time::timeout(Duration::from_secs(3600), &mut idle)
                .await
                .is_err()
        );
        drop(first);
        assert!(
            tokio::time::timeout(Duration::from_secs(3600), &mut idle)
                .await
                .is_err()
        );
        drop(second);
        let ended = Instant::now();
        idle.await;
        assert!(ended.elapsed() >= Duration::from_secs(10));
    }

    #[test]
    fn an_address_is_counted_until_its_connections_end_or_leave_for_their_own_budget() {
        let per_ip = PerIp::new(2, 2);
        let ip: IpAddr = [10, 0, 0, 1].into();
        let a = per_ip.admit(ip);
        let mut b = per_ip.admit(ip);
        assert!(a.is_some() && b.is_some());
        assert!(
            per_ip.admit(ip).is_none(),
            "a third connection was admitted"
        );
        assert!(per_ip.admit([10, 0, 0, 2].into()).is_some());
        if let Some(b) = b.as_mut() {
            b.release();
        }
        let c = per_ip.admit(ip);
        assert!(c.is_some());
        drop((a, b, c));
        let counts = per_ip.counts.lock().unwrap_or_else(PoisonError::into_inner);
        assert!(counts.is_empty(), "{counts:?}");
    }
}

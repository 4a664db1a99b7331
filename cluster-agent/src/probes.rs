//! Kubernetes probes on `--health-listen` (plain HTTP; off unless set — the Helm chart sets `0.0.0.0:8080`):
//!
//! - `GET /readyz`: 200 while at least one tunnel to the relay is up (the body says how many), else 503;
//! - `GET /livez`: 200 while the agent runs: a task of the agent's own answers within [`LIVENESS_TIMEOUT`] (a
//!   runtime too starved to schedule it, or an agent that stopped, is 503);
//! - `GET /metrics`: Prometheus text with `tether_agent_tunnels{transport}`, the tunnels up by transport
//!   (`quic`, `wss`), `tether_agent_open_streams`, the tunnel streams being served, and
//!   `tether_agent_upstream_connections` / `tether_agent_upstream_requests`, the pooled apiserver connections
//!   with a request open and the requests open on them (what the fault-injection tests watch for leaks).
//!
//! Nothing else is served on that port: other paths are 404, other methods 405, request bodies are not read,
//! a client that does not send its request head within [`HEADER_READ_TIMEOUT`] is disconnected, and at most
//! [`MAX_CONNECTIONS`] probe connections are served at once (more wait in the listen backlog). The answers name
//! no cluster, relay or identity.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::forward::Upstream;

/// How long `/livez` waits for the agent's task to answer.
pub const LIVENESS_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a probe client may take to send its request head.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Probe connections served at once.
pub const MAX_CONNECTIONS: usize = 16;

/// What the probes report, shared by the agent loop (which sets it) and the probe server (which reads it).
#[derive(Clone)]
pub(crate) struct Probes {
    /// Tunnels up over QUIC and over WebSocket.
    tunnels: Arc<[AtomicUsize; 2]>,
    live: mpsc::Sender<oneshot::Sender<()>>,
    /// Tunnel streams being served (requests in flight, watches, upgraded pipes), for `/metrics`.
    open_streams: Arc<AtomicUsize>,
    /// The apiserver connections, once made (for `/metrics`).
    upstream: Arc<OnceLock<Upstream>>,
}

/// Counts one served stream in [`Probes`]' gauge until dropped.
pub(crate) struct OpenStream(Arc<AtomicUsize>);

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A task that stops when dropped.
pub(crate) struct Task(JoinHandle<()>);

impl Drop for Task {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Probes {
    /// The probes and the task that answers `/livez`; the answers stop (503) once the task is dropped.
    pub(crate) fn start() -> (Self, Task) {
        let (live, mut asks) = mpsc::channel::<oneshot::Sender<()>>(MAX_CONNECTIONS);
        let responder = tokio::spawn(async move {
            while let Some(ask) = asks.recv().await {
                let _ = ask.send(());
            }
        });
        let probes = Self {
            tunnels: Arc::default(),
            live,
            open_streams: Arc::default(),
            upstream: Arc::default(),
        };
        (probes, Task(responder))
    }

    /// Records how many tunnels are up, over QUIC and over WebSocket (`/readyz`, `/metrics`).
    pub(crate) fn set_tunnels(&self, quic: usize, wss: usize) {
        self.tunnels[0].store(quic, Ordering::Relaxed);
        self.tunnels[1].store(wss, Ordering::Relaxed);
    }

    fn tunnel_count(&self) -> (usize, usize) {
        (
            self.tunnels[0].load(Ordering::Relaxed),
            self.tunnels[1].load(Ordering::Relaxed),
        )
    }

    /// The apiserver connections whose use `/metrics` reports (the first call wins).
    pub(crate) fn set_upstream(&self, upstream: &Upstream) {
        let _ = self.upstream.set(upstream.clone());
    }

    /// Counts a served stream until the returned guard is dropped.
    pub(crate) fn stream_opened(&self) -> OpenStream {
        self.open_streams.fetch_add(1, Ordering::Relaxed);
        OpenStream(self.open_streams.clone())
    }

    async fn alive(&self) -> bool {
        let (ask, answer) = oneshot::channel();
        let asked = async {
            self.live.send(ask).await.ok()?;
            answer.await.ok()
        };
        matches!(
            tokio::time::timeout(LIVENESS_TIMEOUT, asked).await,
            Ok(Some(()))
        )
    }

    async fn answer(&self, req: &Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
        let check = match req.uri().path() {
            "/readyz" => Check::Ready,
            "/livez" => Check::Live,
            "/metrics" => Check::Metrics,
            _ => return plain(StatusCode::NOT_FOUND, "not found\n"),
        };
        if req.method() != Method::GET && req.method() != Method::HEAD {
            return plain(StatusCode::METHOD_NOT_ALLOWED, "use GET\n");
        }
        let (quic, wss) = self.tunnel_count();
        let ok = match check {
            Check::Ready => quic + wss > 0,
            Check::Live => self.alive().await,
            Check::Metrics => {
                let usage = self.upstream.get().map(Upstream::usage).unwrap_or_default();
                let text = format!(
                    "# HELP tether_agent_tunnels Tunnels to the relay that are up, by transport.\n\
                     # TYPE tether_agent_tunnels gauge\n\
                     tether_agent_tunnels{{transport=\"quic\"}} {quic}\n\
                     tether_agent_tunnels{{transport=\"wss\"}} {wss}\n\
                     # HELP tether_agent_open_streams Tunnel streams being served.\n\
                     # TYPE tether_agent_open_streams gauge\n\
                     tether_agent_open_streams {}\n\
                     # HELP tether_agent_upstream_connections Pooled apiserver connections with a request open.\n\
                     # TYPE tether_agent_upstream_connections gauge\n\
                     tether_agent_upstream_connections {}\n\
                     # HELP tether_agent_upstream_requests Requests open on pooled apiserver connections.\n\
                     # TYPE tether_agent_upstream_requests gauge\n\
                     tether_agent_upstream_requests {}\n",
                    self.open_streams.load(Ordering::Relaxed),
                    usage.connections,
                    usage.requests,
                );
                let mut response = plain(StatusCode::OK, "");
                *response.body_mut() = Full::new(Bytes::from(text));
                return response;
            }
        };
        match (check, ok) {
            (Check::Ready, true) => {
                let mut response = plain(StatusCode::OK, "");
                let text = format!("ok: {} tunnel(s) up ({quic} quic, {wss} wss)\n", quic + wss);
                *response.body_mut() = Full::new(Bytes::from(text));
                response
            }
            (Check::Ready, false) => plain(StatusCode::SERVICE_UNAVAILABLE, "no tunnel\n"),
            (Check::Live, true) => plain(StatusCode::OK, "ok\n"),
            (Check::Live, false) => plain(StatusCode::SERVICE_UNAVAILABLE, "not answering\n"),
            (Check::Metrics, _) => plain(StatusCode::OK, ""),
        }
    }
}

#[derive(Clone, Copy)]
enum Check {
    Ready,
    Live,
    Metrics,
}

fn plain(status: StatusCode, text: &'static str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(text.as_bytes())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// Binds `addr` for the probes.
pub(crate) async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

/// Serves the probes on `listener` until the returned task is dropped.
pub(crate) fn serve(listener: TcpListener, probes: Probes) -> Task {
    Task(tokio::spawn(async move {
        let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        loop {
            let Ok(permit) = slots.clone().acquire_owned().await else {
                return;
            };
            let tcp = match listener.accept().await {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    tracing::debug!(error = %e, "probe accept failed");
                    continue;
                }
            };
            let probes = probes.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| {
                    let probes = probes.clone();
                    async move { Ok::<_, Infallible>(probes.answer(&req).await) }
                });
                let served = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HEADER_READ_TIMEOUT)
                    .max_buf_size(8 * 1024)
                    .serve_connection(TokioIo::new(tcp), service);
                // A probe client that keeps its connection open still gets its slot back eventually.
                let _ = tokio::time::timeout(Duration::from_secs(60), served).await;
                drop(permit);
            });
        }
    }))
}

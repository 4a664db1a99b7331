//! The upstream: a minimal HTTPS server (HTTP/1.1 and h2 by ALPN, like an apiserver) that does no work, so
//! that what a scenario measures is the path in front of it. Every body is prepared once and handed out by
//! reference; bulk bodies repeat one 64 KiB chunk.
//!
//! Routes (any method; the request body is ignored; no authentication):
//! - `GET /version` — a Kubernetes version object;
//! - `GET /api/v1/nodes` — a one-node list (enough for an agent's metadata); with `watch=true` the watch is held
//!   open without events until `timeoutSeconds` (at most 300 s), like a quiet cluster;
//! - `GET /api/v1/namespaces/default/pods/NAME` — a small pod (~0.7 KB): the "get" request;
//! - `GET /api/v1/namespaces/default/pods` — a pod list of `list_items` pods: the "list" request; with
//!   `watch=true`, [`WATCH_EVENTS`] `ADDED` events then the end of the watch: the "watch" request;
//! - `GET /api/v1/namespaces/default/pods/bulk/log?limitBytes=N` — N bytes streamed: the "bulk" request;
//! - anything else — 404 with a Kubernetes `Status` body.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode, header};
use http_body::{Body, Frame, SizeHint};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::time::Sleep;
use tokio_rustls::TlsAcceptor;

/// Events sent by a "watch" request before the server ends it.
pub const WATCH_EVENTS: usize = 5;
/// Size of the chunk bulk bodies are made of.
const BULK_CHUNK: usize = 64 * 1024;
/// Longest a quiet watch is held open.
const MAX_QUIET_WATCH: Duration = Duration::from_secs(300);

/// Paths of the request kinds, relative to the server's base URL.
pub mod paths {
    /// A small object.
    pub const GET: &str = "/api/v1/namespaces/default/pods/pod-1";
    /// A list.
    pub const LIST: &str = "/api/v1/namespaces/default/pods";
    /// A short watch (ends by itself after a few events).
    pub const WATCH: &str = "/api/v1/namespaces/default/pods?watch=true&resourceVersion=0";
    /// A streamed body of `limitBytes` bytes (append the number).
    pub const BULK: &str = "/api/v1/namespaces/default/pods/bulk/log?limitBytes=";
}

/// The prepared bodies.
#[derive(Debug)]
struct Bodies {
    version: Bytes,
    nodes: Bytes,
    pod: Bytes,
    list: Bytes,
    events: Vec<Bytes>,
    chunk: Bytes,
    not_found: Bytes,
}

fn pod(i: usize) -> serde_json::Value {
    json!({
        "kind": "Pod", "apiVersion": "v1",
        "metadata": {
            "name": format!("pod-{i}"), "namespace": "default", "uid": format!("00000000-0000-4000-8000-{i:012}"),
            "resourceVersion": format!("{}", 1000 + i), "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": {"app": "loadtest", "tier": "backend"}
        },
        "spec": {
            "nodeName": "node-1", "restartPolicy": "Always", "serviceAccountName": "default",
            "containers": [{"name": "app", "image": "registry.example/app:1.0",
                            "ports": [{"containerPort": 8080, "protocol": "TCP"}],
                            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}}}]
        },
        "status": {"phase": "Running", "podIP": format!("10.0.{}.{}", i / 250, i % 250 + 1),
                   "startTime": "2026-01-01T00:00:01Z"}
    })
}

impl Bodies {
    fn new(list_items: usize) -> Self {
        let to_bytes = |v: &serde_json::Value| Bytes::from(v.to_string());
        let items: Vec<serde_json::Value> = (0..list_items).map(pod).collect();
        let events = (0..WATCH_EVENTS)
            .map(|i| Bytes::from(format!("{}\n", json!({"type": "ADDED", "object": pod(i)}))))
            .collect();
        Self {
            version: to_bytes(&json!({
                "major": "1", "minor": "33", "gitVersion": "v1.33.0-loadtest", "platform": "linux/amd64"
            })),
            nodes: to_bytes(&json!({
                "kind": "NodeList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"},
                "items": [{
                    "kind": "Node", "apiVersion": "v1",
                    "metadata": {"name": "node-1", "resourceVersion": "1", "uid": "00000000-0000-4000-8000-000000000001"},
                    "spec": {"providerID": "loadtest://node-1"},
                    "status": {"capacity": {"cpu": "2", "memory": "4Gi"},
                               "allocatable": {"cpu": "2", "memory": "4Gi"},
                               "nodeInfo": {"kubeletVersion": "v1.33.0", "architecture": "amd64",
                                            "operatingSystem": "linux", "osImage": "loadtest",
                                            "kernelVersion": "6", "containerRuntimeVersion": "none://0",
                                            "kubeProxyVersion": "", "machineID": "", "systemUUID": "",
                                            "bootID": ""}}
                }]
            })),
            pod: to_bytes(&pod(1)),
            list: to_bytes(&json!({
                "kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "2000"}, "items": items
            })),
            events,
            chunk: Bytes::from(vec![b'x'; BULK_CHUNK]),
            not_found: to_bytes(&json!({
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": "not found", "reason": "NotFound", "code": 404
            })),
        }
    }
}

/// A response body: queued chunks, then an optional repeated chunk up to a byte count, then an optional hold.
pub struct UpBody {
    queue: VecDeque<Bytes>,
    repeat: Option<(Bytes, u64)>,
    hold: Option<Pin<Box<Sleep>>>,
}

impl UpBody {
    fn full(b: Bytes) -> Self {
        Self {
            queue: VecDeque::from([b]),
            repeat: None,
            hold: None,
        }
    }
}

impl Body for UpBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if let Some(b) = self.queue.pop_front() {
            return Poll::Ready(Some(Ok(Frame::data(b))));
        }
        if let Some((chunk, remaining)) = &mut self.repeat
            && *remaining > 0
        {
            let n = (chunk.len() as u64).min(*remaining) as usize;
            *remaining -= n as u64;
            return Poll::Ready(Some(Ok(Frame::data(chunk.slice(..n)))));
        }
        if let Some(sleep) = &mut self.hold {
            return match sleep.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    self.hold = None;
                    Poll::Ready(None)
                }
                Poll::Pending => Poll::Pending,
            };
        }
        Poll::Ready(None)
    }

    fn is_end_stream(&self) -> bool {
        self.queue.is_empty()
            && self.repeat.as_ref().is_none_or(|(_, r)| *r == 0)
            && self.hold.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        if self.hold.is_some() {
            return SizeHint::default();
        }
        let queued: u64 = self.queue.iter().map(|b| b.len() as u64).sum();
        SizeHint::with_exact(queued + self.repeat.as_ref().map_or(0, |(_, r)| *r))
    }
}

fn query_param<'a>(query: &'a str, name: &str) -> Option<&'a str> {
    query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

fn respond(bodies: &Bodies, path: &str, query: &str) -> Response<UpBody> {
    let json = |status: StatusCode, body: UpBody| {
        let mut r = Response::new(body);
        *r.status_mut() = status;
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static("application/json"),
        );
        r
    };
    let watch = matches!(query_param(query, "watch"), Some("true" | "1"));
    match path {
        "/version" => json(StatusCode::OK, UpBody::full(bodies.version.clone())),
        "/api/v1/nodes" if watch => {
            let secs = query_param(query, "timeoutSeconds")
                .and_then(|s| s.parse().ok())
                .map_or(MAX_QUIET_WATCH, Duration::from_secs)
                .min(MAX_QUIET_WATCH);
            json(
                StatusCode::OK,
                UpBody {
                    queue: VecDeque::new(),
                    repeat: None,
                    hold: Some(Box::pin(tokio::time::sleep(secs))),
                },
            )
        }
        "/api/v1/nodes" => json(StatusCode::OK, UpBody::full(bodies.nodes.clone())),
        "/api/v1/namespaces/default/pods" if watch => json(
            StatusCode::OK,
            UpBody {
                queue: bodies.events.iter().cloned().collect(),
                repeat: None,
                hold: None,
            },
        ),
        "/api/v1/namespaces/default/pods" => {
            json(StatusCode::OK, UpBody::full(bodies.list.clone()))
        }
        "/api/v1/namespaces/default/pods/bulk/log" => {
            let n = query_param(query, "limitBytes")
                .and_then(|s| s.parse().ok())
                .unwrap_or(0u64);
            let mut r = Response::new(UpBody {
                queue: VecDeque::new(),
                repeat: Some((bodies.chunk.clone(), n)),
                hold: None,
            });
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static("text/plain"),
            );
            r
        }
        p if p.starts_with("/api/v1/namespaces/default/pods/")
            && !p["/api/v1/namespaces/default/pods/".len()..].contains('/') =>
        {
            json(StatusCode::OK, UpBody::full(bodies.pod.clone()))
        }
        _ => json(
            StatusCode::NOT_FOUND,
            UpBody::full(bodies.not_found.clone()),
        ),
    }
}

/// Serves the upstream on `listener` with `tls` until `shutdown` resolves. `list_items` sizes the list body.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    list_items: usize,
    shutdown: impl Future<Output = ()>,
) {
    let bodies = Arc::new(Bodies::new(list_items));
    let acceptor = TlsAcceptor::from(tls);
    tokio::pin!(shutdown);
    loop {
        let (tcp, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
            () = &mut shutdown => return,
        };
        let _ = tcp.set_nodelay(true);
        let acceptor = acceptor.clone();
        let bodies = bodies.clone();
        tokio::spawn(async move {
            let Ok(tls) = acceptor.accept(tcp).await else {
                return;
            };
            let service = service_fn(move |req: Request<hyper::body::Incoming>| {
                let resp = respond(&bodies, req.uri().path(), req.uri().query().unwrap_or(""));
                async move { Ok::<_, Infallible>(resp) }
            });
            let mut builder = auto::Builder::new(TokioExecutor::new());
            builder.http2().max_concurrent_streams(1000);
            let _ = builder.serve_connection(TokioIo::new(tls), service).await;
        });
    }
}

/// Binds `addr` and serves until `shutdown`; returns the bound address through `bound` first.
pub async fn bind_and_serve(
    addr: SocketAddr,
    tls: Arc<rustls::ServerConfig>,
    list_items: usize,
    bound: impl FnOnce(SocketAddr),
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    bound(listener.local_addr()?);
    serve(listener, tls, list_items, shutdown).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    async fn collect(mut body: UpBody) -> Vec<Bytes> {
        let mut out = Vec::new();
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame;
            out.extend(frame.into_data().ok());
        }
        out
    }

    #[tokio::test]
    async fn routes_answer_kubectl_like_requests() -> anyhow::Result<()> {
        let bodies = Bodies::new(10);
        let get = respond(&bodies, "/api/v1/namespaces/default/pods/pod-1", "");
        assert_eq!(get.status(), StatusCode::OK);
        let v: serde_json::Value =
            serde_json::from_slice(&collect(get.into_body()).await.concat())?;
        assert_eq!(v["kind"], "Pod");

        let list = respond(&bodies, "/api/v1/namespaces/default/pods", "limit=500");
        let v: serde_json::Value =
            serde_json::from_slice(&collect(list.into_body()).await.concat())?;
        assert_eq!(v["items"].as_array().map(Vec::len), Some(10));

        let watch = respond(
            &bodies,
            "/api/v1/namespaces/default/pods",
            "watch=true&resourceVersion=0",
        );
        assert_eq!(collect(watch.into_body()).await.len(), WATCH_EVENTS);

        let bulk = respond(
            &bodies,
            "/api/v1/namespaces/default/pods/bulk/log",
            "limitBytes=200000",
        );
        assert_eq!(bulk.body().size_hint().exact(), Some(200_000));
        let total: usize = collect(bulk.into_body()).await.iter().map(Bytes::len).sum();
        assert_eq!(total, 200_000);

        assert_eq!(
            respond(&bodies, "/nope", "").status(),
            StatusCode::NOT_FOUND
        );
        assert_eq!(respond(&bodies, "/version", "").status(), StatusCode::OK);
        Ok(())
    }

    #[tokio::test(start_paused = true)]
    async fn quiet_watches_are_held_until_their_timeout() {
        let bodies = Bodies::new(1);
        let watch = respond(&bodies, "/api/v1/nodes", "watch=true&timeoutSeconds=7");
        let body = watch.into_body();
        assert!(!body.is_end_stream());
        let start = tokio::time::Instant::now();
        assert!(collect(body).await.is_empty());
        assert_eq!(start.elapsed().as_secs(), 7);
    }
}

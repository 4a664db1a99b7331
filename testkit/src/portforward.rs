//! `…/pods/NAME/portforward`: the kubelet's side of `kubectl port-forward`, answered by small TCP servers on
//! loopback that stand in for the pod's ports ([`PodNetwork`]: an HTTP responder for port 80 and 8080, an echo
//! server for every other port).
//!
//! Two transports carry the same SPDY/3.1 session (see [`crate::spdy`]):
//! - `Upgrade: SPDY/3.1` with `X-Stream-Protocol-Version: portforward.k8s.io` (kubectl ≤ 1.30, and newer ones
//!   when the WebSocket upgrade fails);
//! - a WebSocket with subprotocol `SPDY/3.1+portforward.k8s.io`, whose binary messages carry the SPDY bytes
//!   (kubectl ≥ 1.31, KEP-4006 "tunneling"), as kube-apiserver accepts them.
//!
//! In the session the client opens, per local connection, an `error` stream and then a `data` stream, both with
//! headers `port` and `requestID`. The data stream is piped to the pod port; if the port cannot be reached the
//! reason is written on the error stream (kubectl prints it). When the pod side ends, its data stream gets FIN,
//! then the error stream does (kubectl waits for both).
//!
//! What it does not do: the `portforward.k8s.io` WebSocket channel protocol without SPDY (`v4.channel.k8s.io`
//! framing with `?ports=`), which kubectl never uses.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use futures_util::{SinkExt as _, StreamExt as _};
use http::{HeaderValue, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::body::Body;
use crate::handlers::Target;
use crate::resources::Resource;
use crate::server::Shared;
use crate::spdy::{self, Decoder, Encoder, Frame};
use crate::status::ApiError;

/// The SPDY subprotocol name kubectl offers in `X-Stream-Protocol-Version`.
const PORT_FORWARD_PROTOCOL: &str = "portforward.k8s.io";
/// The WebSocket subprotocol of SPDY tunneled over a WebSocket.
const TUNNEL_PROTOCOL: &str = "SPDY/3.1+portforward.k8s.io";
/// Largest DATA frame sent (what Go's io.Copy writes at a time).
const CHUNK: usize = 32 * 1024;
/// RST_STREAM status PROTOCOL_ERROR.
const PROTOCOL_ERROR: u32 = 1;

/// The loopback servers that answer for pod ports.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PodNetwork {
    http: SocketAddr,
    echo: SocketAddr,
}

impl PodNetwork {
    /// Binds the HTTP responder and the echo server on 127.0.0.1 and serves them until `shutdown`.
    pub(crate) async fn start(
        shutdown: &CancellationToken,
        tracker: &TaskTracker,
    ) -> std::io::Result<PodNetwork> {
        let localhost = SocketAddr::from(([127, 0, 0, 1], 0));
        let http = TcpListener::bind(localhost).await?;
        let echo = TcpListener::bind(localhost).await?;
        let network = PodNetwork {
            http: http.local_addr()?,
            echo: echo.local_addr()?,
        };
        tracker.spawn(serve(http, shutdown.clone(), tracker.clone(), serve_http));
        tracker.spawn(serve(echo, shutdown.clone(), tracker.clone(), serve_echo));
        Ok(network)
    }

    /// Where the pod's `port` is answered.
    fn address(&self, port: u16) -> SocketAddr {
        match port {
            80 | 8080 => self.http,
            _ => self.echo,
        }
    }
}

async fn serve<F, Fut>(
    listener: TcpListener,
    shutdown: CancellationToken,
    tracker: TaskTracker,
    handler: F,
) where
    F: Fn(TcpStream) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((tcp, _)) => {
                let shutdown = shutdown.clone();
                let conn = handler(tcp);
                tracker.spawn(async move {
                    tokio::select! {
                        _ = shutdown.cancelled() => {}
                        _ = conn => {}
                    }
                });
            }
            Err(error) => {
                tracing::warn!(%error, "pod network accept failed");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(std::time::Duration::from_millis(100)) => {}
                }
            }
        }
    }
}

/// Port 7 and friends: every byte comes back, and end-of-stream is echoed too.
async fn serve_echo(mut tcp: TcpStream) {
    let (mut r, mut w) = tcp.split();
    let _ = tokio::io::copy(&mut r, &mut w).await;
    let _ = w.shutdown().await;
}

/// Port 80: a tiny web server, one line of text naming the path.
async fn serve_http(tcp: TcpStream) {
    let service = hyper::service::service_fn(|req: Request<Incoming>| async move {
        let text = format!(
            "Hello from the Tether sample cluster: {} {}\n",
            req.method(),
            req.uri().path()
        );
        let mut response = Response::new(http_body_util::Full::new(Bytes::from(text)));
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        Ok::<_, std::convert::Infallible>(response)
    });
    // Half-close: a client that sends its request and shuts down writing still gets the answer.
    let _ = hyper::server::conn::http1::Builder::new()
        .half_close(true)
        .serve_connection(TokioIo::new(tcp), service)
        .await;
}

fn header_has_token(headers: &http::HeaderMap, name: header::HeaderName, token: &str) -> bool {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

/// The transport a port-forward request asked for.
enum Transport {
    Spdy,
    WebSocket { accept: String },
}

pub(crate) fn handle(
    shared: &Arc<Shared>,
    t: &Target,
    mut req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let namespace = t.namespace.clone().unwrap_or_default();
    let name = t.name.clone().unwrap_or_default();
    let pod = shared.store.get(Resource::Pods, &namespace, &name)?;
    if pod["status"]["phase"] != "Running" {
        return Err(ApiError::bad_request(format!(
            "pod {name} is not running and cannot be port-forwarded"
        )));
    }
    let uid = pod["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let headers = req.headers();
    let upgrade = headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !header_has_token(headers, header::CONNECTION, "upgrade") {
        return Err(ApiError::bad_request("Upgrade request required"));
    }
    let transport = if upgrade.eq_ignore_ascii_case("websocket") {
        if !header_has_token(headers, header::SEC_WEBSOCKET_PROTOCOL, TUNNEL_PROTOCOL) {
            return Err(ApiError::bad_request(format!(
                "port-forward over WebSocket needs the subprotocol {TUNNEL_PROTOCOL}"
            )));
        }
        let key = headers
            .get(header::SEC_WEBSOCKET_KEY)
            .ok_or_else(|| ApiError::bad_request("missing Sec-WebSocket-Key"))?;
        Transport::WebSocket {
            accept: tokio_tungstenite::tungstenite::handshake::derive_accept_key(key.as_bytes()),
        }
    } else if upgrade.eq_ignore_ascii_case("SPDY/3.1") {
        if !header_has_token(
            headers,
            header::HeaderName::from_static("x-stream-protocol-version"),
            PORT_FORWARD_PROTOCOL,
        ) {
            return Err(ApiError::bad_request(format!(
                "unable to upgrade: unable to negotiate protocol: client supports {:?}, server supports [\"{PORT_FORWARD_PROTOCOL}\"]",
                headers
                    .get_all("x-stream-protocol-version")
                    .iter()
                    .filter_map(|v| v.to_str().ok())
                    .collect::<Vec<_>>()
            )));
        }
        Transport::Spdy
    } else {
        return Err(ApiError::bad_request(
            "unable to upgrade: missing upgrade headers in request",
        ));
    };

    let on_upgrade = hyper::upgrade::on(&mut req);
    let network = shared.pod_network;
    let shutdown = shared.shutdown.clone();
    let tracker = shared.tracker.clone();
    let pod_name = format!("{namespace}/{name}");
    let is_ws = matches!(transport, Transport::WebSocket { .. });
    shared.tracker.spawn(async move {
        let upgraded = match on_upgrade.await {
            Ok(upgraded) => TokioIo::new(upgraded),
            Err(error) => {
                tracing::debug!(%error, "port-forward upgrade failed");
                return;
            }
        };
        let pod = PodRef {
            name: pod_name,
            uid,
            network,
        };
        tracing::debug!(pod = %pod.name, websocket = is_ws, "port-forward session");
        let session = async {
            if is_ws {
                let ws = WebSocketStream::from_raw_socket(upgraded, Role::Server, None).await;
                let (near, far) = tokio::io::duplex(256 * 1024);
                tokio::join!(tunnel(ws, far), session(near, &pod, &tracker));
            } else {
                session(upgraded, &pod, &tracker).await;
            }
        };
        tokio::select! {
            _ = shutdown.cancelled() => {}
            _ = session => {}
        }
    });

    let mut response = Response::new(Body::empty());
    *response.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = response.headers_mut();
    h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    match transport {
        Transport::Spdy => {
            h.insert(header::UPGRADE, HeaderValue::from_static("SPDY/3.1"));
            h.insert(
                "x-stream-protocol-version",
                HeaderValue::from_static(PORT_FORWARD_PROTOCOL),
            );
        }
        Transport::WebSocket { accept } => {
            h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
            if let Ok(v) = HeaderValue::from_str(&accept) {
                h.insert(header::SEC_WEBSOCKET_ACCEPT, v);
            }
            h.insert(
                header::SEC_WEBSOCKET_PROTOCOL,
                HeaderValue::from_static(TUNNEL_PROTOCOL),
            );
        }
    }
    Ok(response)
}

/// Pumps bytes between a WebSocket (binary messages) and one end of a duplex pipe.
async fn tunnel<S>(ws: WebSocketStream<S>, pipe: tokio::io::DuplexStream)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let (mut ws_tx, mut ws_rx) = ws.split();
    let (mut pipe_rx, mut pipe_tx) = tokio::io::split(pipe);
    let inbound = async {
        while let Some(Ok(message)) = ws_rx.next().await {
            match message {
                Message::Binary(data) if pipe_tx.write_all(&data).await.is_err() => break,
                Message::Close(_) => break,
                _ => {}
            }
        }
        let _ = pipe_tx.shutdown().await;
    };
    let outbound = async {
        let mut buf = vec![0u8; CHUNK + 64];
        loop {
            match pipe_rx.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let frame = Bytes::copy_from_slice(&buf[..n]);
                    if ws_tx.send(Message::Binary(frame)).await.is_err() {
                        break;
                    }
                }
            }
        }
        let _ = ws_tx.close().await;
    };
    tokio::join!(inbound, outbound);
}

/// The pod a session forwards to.
struct PodRef {
    name: String,
    uid: String,
    network: PodNetwork,
}

/// One SPDY session: reads frames, answers every new stream, pairs error and data streams by `requestID`, and
/// starts a [`forward`] for each data stream.
async fn session<S>(io: S, pod: &PodRef, tracker: &TaskTracker)
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (mut rd, mut wr) = tokio::io::split(io);
    let (out_tx, mut out_rx) = mpsc::channel::<Bytes>(64);
    let writer = async move {
        while let Some(bytes) = out_rx.recv().await {
            if wr.write_all(&bytes).await.is_err() {
                break;
            }
        }
        let _ = wr.shutdown().await;
    };
    let reader = async {
        let mut decoder = Decoder::new();
        let mut encoder = Encoder::new();
        let mut buf = BytesMut::with_capacity(64 * 1024);
        let mut error_streams: HashMap<String, u32> = HashMap::new();
        let mut data_streams: HashMap<u32, mpsc::Sender<Bytes>> = HashMap::new();
        'read: loop {
            loop {
                let frame = match decoder.decode(&mut buf) {
                    Ok(Some(frame)) => frame,
                    Ok(None) => break,
                    Err(error) => {
                        tracing::debug!(%error, "port-forward: not SPDY/3");
                        break 'read;
                    }
                };
                let mut out = BytesMut::new();
                match frame {
                    Frame::SynStream {
                        stream_id, headers, ..
                    } => {
                        let get = |k: &str| {
                            headers
                                .iter()
                                .find(|(name, _)| name == k)
                                .map(|(_, v)| v.as_str())
                        };
                        let request = get("requestid").unwrap_or("").to_string();
                        let port = get("port").and_then(|p| p.parse::<u16>().ok());
                        match (get("streamtype"), port) {
                            (Some("error"), Some(_)) => {
                                encoder.syn_reply(stream_id, false, &mut out);
                                error_streams.insert(request, stream_id);
                            }
                            (Some("data"), Some(port)) if port > 0 => {
                                encoder.syn_reply(stream_id, false, &mut out);
                                let (tx, rx) = mpsc::channel(16);
                                data_streams.insert(stream_id, tx);
                                let error_stream = error_streams.remove(&request);
                                tracker.spawn(forward(
                                    pod.network.address(port),
                                    port,
                                    format!("{} uid {}", pod.name, pod.uid),
                                    stream_id,
                                    error_stream,
                                    rx,
                                    out_tx.clone(),
                                ));
                            }
                            _ => spdy::rst_stream(stream_id, PROTOCOL_ERROR, &mut out),
                        }
                    }
                    Frame::Data {
                        stream_id,
                        fin,
                        data,
                    } => {
                        if let Some(tx) = data_streams.get(&stream_id)
                            && !data.is_empty()
                            && tx.send(data).await.is_err()
                        {
                            data_streams.remove(&stream_id);
                        }
                        if fin {
                            // Dropping the sender half-closes the pod connection.
                            data_streams.remove(&stream_id);
                        }
                    }
                    Frame::RstStream { stream_id, .. } => {
                        data_streams.remove(&stream_id);
                    }
                    Frame::Ping(id) => spdy::ping(id, &mut out),
                    Frame::GoAway => break 'read,
                    Frame::SynReply { .. } | Frame::Ignored => {}
                }
                if !out.is_empty() && out_tx.send(out.freeze()).await.is_err() {
                    break 'read;
                }
            }
            match rd.read_buf(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
        // Ends every forward's client-to-pod direction; their pod-to-client side ends with the pod connection.
        drop(data_streams);
        drop(out_tx);
    };
    tokio::join!(reader, writer);
}

/// Pipes one data stream to the pod port; when the pod side ends, closes the data and error streams.
async fn forward(
    addr: SocketAddr,
    port: u16,
    pod: String,
    data_stream: u32,
    error_stream: Option<u32>,
    mut from_client: mpsc::Receiver<Bytes>,
    out: mpsc::Sender<Bytes>,
) {
    let send = |frame: BytesMut| {
        let out = out.clone();
        async move { out.send(frame.freeze()).await.is_ok() }
    };
    let tcp = match TcpStream::connect(addr).await {
        Ok(tcp) => tcp,
        Err(error) => {
            let mut frame = BytesMut::new();
            if let Some(id) = error_stream {
                let message = format!(
                    "error forwarding port {port} to pod {pod}: failed to connect to localhost:{port} inside namespace: {error}"
                );
                spdy::data(id, true, message.as_bytes(), &mut frame);
            }
            spdy::data(data_stream, true, &[], &mut frame);
            send(frame).await;
            return;
        }
    };
    let _ = tcp.set_nodelay(true);
    let (mut tcp_rd, mut tcp_wr) = tcp.into_split();
    let to_pod = async {
        while let Some(bytes) = from_client.recv().await {
            if tcp_wr.write_all(&bytes).await.is_err() {
                break;
            }
        }
        let _ = tcp_wr.shutdown().await;
    };
    let to_client = async {
        let mut buf = vec![0u8; CHUNK];
        loop {
            match tcp_rd.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let mut frame = BytesMut::with_capacity(n + 8);
                    spdy::data(data_stream, false, &buf[..n], &mut frame);
                    if !send(frame).await {
                        return;
                    }
                }
            }
        }
        // The pod side is done: FIN the data stream, then the error stream with no message (kubectl waits for
        // both before it closes the local connection), while the client may still be sending.
        let mut frame = BytesMut::new();
        spdy::data(data_stream, true, &[], &mut frame);
        if let Some(id) = error_stream {
            spdy::data(id, true, &[], &mut frame);
        }
        send(frame).await;
    };
    tokio::join!(to_pod, to_client);
}

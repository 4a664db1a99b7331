//! One user request → one HTTP/1.1 exchange over one byte stream (a tunnel stream in production, any
//! `AsyncRead + AsyncWrite` in tests).
//!
//! The request line loses the `/clusters/NAME` prefix, hop-by-hop headers are dropped, `Host` becomes the
//! cluster name, and bodies stream both ways without being collected. A `101 Switching Protocols` answer
//! turns the user's connection and the stream into one raw byte pipe (WebSocket, SPDY), half-close included.

use std::error::Error as StdError;
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode, Uri, Version};
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use tether_tunnel::heads::{self, ReadChunk};
use tether_tunnel::{TunnelError, code};
use tokio::io::{AsyncRead, AsyncWrite};

use crate::api_error::ApiError;
use crate::body::{Body, BoxError};
use crate::ends;
use crate::spdy;

/// Headers that describe one hop, never forwarded (RFC 9110 §7.6.1, plus the legacy proxy ones).
static HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
];

/// How long a request may be left without an answer to its OPEN beyond the stream's own deadline (which
/// the tunnel enforces); only a safety net against a lost answer.
const ACCEPT_GRACE: Duration = Duration::from_secs(5);

/// Where the request goes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Target<'a> {
    /// The cluster name (becomes `Host`).
    pub(crate) cluster: &'a str,
    /// Path and query to send, starting with `/`.
    pub(crate) path_and_query: &'a str,
    /// The stream's open deadline, for the 504 message.
    pub(crate) open_timeout: Duration,
    /// How long the response head may take, the stream's accept included; past it, 504 and the stream is
    /// reset (so the agent drops the request, sent or not). The body of a response whose head arrived is not
    /// bounded (watch, `logs -f`, upgraded pipes).
    pub(crate) request_timeout: Duration,
    /// Cancelled when this replica stops serving (the end of a drain's first part): a JSON watch then ends
    /// cleanly at its next event boundary, so its client watches again through the load balancer elsewhere.
    pub(crate) watches_end: Option<&'a tokio_util::sync::CancellationToken>,
}

/// Sends `req` over `io` as HTTP/1.1 and returns the response to give the user. `accepted` resolves when
/// the peer answers the stream's OPEN; until it does, the response is not awaited alone, so a stream that
/// is refused or never accepted maps to 502/504 rather than to a confusing I/O error. `guard` is kept alive
/// as long as an upgraded byte pipe runs (the connection slot).
pub(crate) async fn forward<IO, B, A, G>(
    io: IO,
    accepted: A,
    mut req: Request<B>,
    target: Target<'_>,
    guard: G,
) -> Result<Response<Body>, ApiError>
where
    G: Send + 'static,
    IO: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    A: Future<Output = Result<Bytes, TunnelError>>,
{
    let upgrade = is_upgrade_request(&req);
    let user_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
    let out = outgoing_request(req, target, upgrade)?;

    let (mut sender, conn) = hyper::client::conn::http1::Builder::new()
        .max_buf_size(1024 * 1024)
        .handshake::<_, B>(TokioIo::new(io))
        .await
        .map_err(|e| ApiError::internal(format!("cannot start HTTP on the tunnel stream: {e}")))?;
    let cluster = target.cluster.to_owned();
    let conn_task = tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(cluster = %cluster, error = %e, "tunnel stream HTTP connection ended with an error");
        }
    });

    let accepted = answer_within(accepted, target);
    let response = sender.send_request(out);
    tokio::pin!(accepted, response);
    let head = async {
        Ok::<_, ApiError>(tokio::select! {
        biased;
        answer = &mut accepted => match answer {
            Ok(_) => response.await.map_err(|e| response_error(&e, target))?,
            Err(e) => return Err(tunnel_error(e, target)),
        },
        result = &mut response => match result {
            Ok(resp) => resp,
            Err(e) => {
                // The answer to the OPEN explains a failed exchange better than the HTTP error, when it is in.
                if let Some(Err(te)) = accepted.now_or_never() {
                    return Err(tunnel_error(te, target));
                }
                return Err(response_error(&e, target));
            }
        },
        })
    };
    let mut resp = match tokio::time::timeout(target.request_timeout, head).await {
        Ok(resp) => resp?,
        Err(_) => {
            // Dropping the HTTP connection drops the tunnel stream: the agent sees a reset and cancels the
            // request, whether it was still queued there or already sent upstream.
            conn_task.abort();
            return Err(head_timeout(target));
        }
    };

    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        let Some(user_upgrade) = user_upgrade else {
            return Err(ApiError::tunnel(
                StatusCode::BAD_GATEWAY,
                "BadGateway",
                "the cluster answered 101 Switching Protocols to a request that did not ask to upgrade",
            ));
        };
        let agent_upgrade = hyper::upgrade::on(&mut resp);
        let cluster = target.cluster.to_owned();
        let headers = resp.headers().clone();
        tokio::spawn(async move {
            let _guard = guard;
            let (user, agent) = tokio::join!(user_upgrade, agent_upgrade);
            match (user, agent) {
                (Ok(user), Ok(agent)) => {
                    let (user, agent) = (TokioIo::new(user), TokioIo::new(agent));
                    pipe(user, agent, &headers, &cluster).await;
                }
                (user, agent) => tracing::debug!(
                    cluster = %cluster,
                    user = ?user.err(),
                    agent = ?agent.err(),
                    "upgrade did not complete on both sides"
                ),
            }
        });
        let (mut parts, _) = resp.into_parts();
        // The hop to the agent ends with this exchange, so its HTTP layer may have added `close` to the
        // Connection header; the user's hop is upgrading, and clients such as kube-rs refuse anything but
        // `Connection: Upgrade` on a 101.
        parts
            .headers
            .insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
        return Ok(Response::from_parts(parts, crate::body::empty()));
    }

    strip_hop_by_hop(resp.headers_mut(), false);
    Ok(for_the_user(resp, target))
}

/// How long the peer's answer to the OPEN is awaited: the stream's deadline (which the tunnel enforces) and
/// a grace against a lost answer.
async fn answer_within<A>(accepted: A, target: Target<'_>) -> Result<Bytes, TunnelError>
where
    A: Future<Output = Result<Bytes, TunnelError>>,
{
    tokio::time::timeout(target.open_timeout + ACCEPT_GRACE, accepted)
        .await
        .unwrap_or(Err(TunnelError::TimedOut(target.open_timeout)))
}

/// The cluster's response as the user gets it (hop-by-hop headers already gone): a JSON watch ends with an
/// ERROR event when its path breaks, and cleanly when its tunnel goes away.
fn for_the_user<B>(resp: Response<B>, target: Target<'_>) -> Response<Body>
where
    B: http_body::Body<Data = Bytes> + Send + Sync + Unpin + 'static,
    B::Error: Into<BoxError>,
{
    if resp.status().is_success()
        && ends::is_watch_request(target.path_and_query)
        && ends::is_json(resp.headers())
    {
        let cluster = target.cluster;
        return resp.map(|b| {
            ends::WatchBody::new(b, cluster, explain_body_error)
                .ending_with(target.watches_end)
                .boxed()
        });
    }
    resp.map(|b| b.map_err(Into::into).boxed())
}

/// Largest response head read from an agent (hyper's HTTP/1.1 client on [`forward`] allows as much).
const MAX_RESPONSE_HEAD: usize = 1024 * 1024;

/// Sends `req` over `io`, a stream of kind [`tether_tunnel::kind::HTTP_HEADS`]: the request head as a binary
/// block, the body as it is, then the end of our side (not for an upgrade, whose stream becomes the byte
/// pipe); the response head comes back as a block and its body is what follows, to the end of the stream.
/// No HTTP/1.1 is parsed or written on the tunnel. Otherwise as [`forward`]: `accepted` resolves with the
/// peer's answer to the OPEN, `guard` lives as long as an upgraded pipe, and `abort` resets the stream (the
/// request is cut: head timeout, or the user's request body broke off).
pub(crate) async fn forward_heads<IO, B, A, G, F>(
    io: IO,
    accepted: A,
    abort: F,
    mut req: Request<B>,
    target: Target<'_>,
    guard: G,
) -> Result<Response<Body>, ApiError>
where
    G: Send + 'static,
    IO: ReadChunk + AsyncWrite + Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<BoxError>,
    A: Future<Output = Result<Bytes, TunnelError>>,
    F: Fn() + Clone + Send + 'static,
{
    let upgrade = is_upgrade_request(&req);
    let user_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
    let (parts, body) = req.into_parts();
    let has_body = !body.is_end_stream();
    if upgrade && has_body {
        return Err(ApiError::bad_request(
            "a request that asks to switch protocols must not have a body",
        ));
    }
    let block = encode_head(&parts, target, upgrade, has_body)?;
    drop(parts);
    let body = has_body.then_some(body);
    exchange(
        io,
        accepted,
        abort,
        block,
        body,
        user_upgrade,
        target,
        guard,
    )
    .await
}

/// [`forward_heads`] for a request without a body that asks for no upgrade, encoded from its head as it is
/// (borrowed): the caller keeps it to send again elsewhere if this tunnel goes away, without a copy per request.
pub(crate) async fn forward_heads_bodyless<IO, A, G, F>(
    io: IO,
    accepted: A,
    abort: F,
    parts: &http::request::Parts,
    target: Target<'_>,
    guard: G,
) -> Result<Response<Body>, ApiError>
where
    G: Send + 'static,
    IO: ReadChunk + AsyncWrite + Send + 'static,
    A: Future<Output = Result<Bytes, TunnelError>>,
    F: Fn() + Clone + Send + 'static,
{
    let block = encode_head(parts, target, false, false)?;
    exchange::<_, http_body_util::Empty<Bytes>, _, _, _>(
        io, accepted, abort, block, None, None, target, guard,
    )
    .await
}

/// The request head block that goes over the tunnel: the user's method and headers less the hop-by-hop ones
/// (as [`strip_hop_by_hop`] removes them; for an upgrade, `Upgrade` stays and `Connection: upgrade` is added)
/// and less `Host`, then `Host: CLUSTER`. Encoded straight from the user's head: no edited copy of its headers.
fn encode_head(
    parts: &http::request::Parts,
    target: Target<'_>,
    upgrade: bool,
    has_body: bool,
) -> Result<Bytes, ApiError> {
    // The path comes from a request target hyper parsed, and the name from a checked cluster name; these only
    // keep what could not be a request line's target or a header value off the tunnel.
    let pq = target.path_and_query;
    if !pq.starts_with('/') || pq.bytes().any(|b| b <= b' ' || b == 0x7f) {
        return Err(ApiError::bad_request(format!(
            "invalid request path {pq:?}"
        )));
    }
    if target.cluster.is_empty() || !target.cluster.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ApiError::bad_request(format!(
            "invalid cluster name {:?}",
            target.cluster
        )));
    }
    let headers = &parts.headers;
    // The names `Connection` lists (usually none): hop-by-hop too.
    let named: Vec<HeaderName> = if headers.contains_key(header::CONNECTION) {
        connection_tokens(headers)
            .filter(|t| !(upgrade && t.eq_ignore_ascii_case("upgrade")))
            .filter_map(|t| HeaderName::from_bytes(t.as_bytes()).ok())
            .collect()
    } else {
        Vec::new()
    };
    let connection: &[(&[u8], &[u8])] = if upgrade {
        &[(b"connection", b"upgrade")]
    } else {
        &[]
    };
    let fields = || {
        headers
            .iter()
            .filter(|(name, _)| {
                !(HOP_BY_HOP.contains(name)
                    || named.contains(name)
                    || (!upgrade && *name == header::UPGRADE)
                    || *name == header::HOST)
            })
            .map(|(n, v)| (n.as_str().as_bytes(), v.as_bytes()))
            .chain(connection.iter().copied())
            .chain(std::iter::once((&b"host"[..], target.cluster.as_bytes())))
    };
    heads::encode_request_fields(&parts.method, pq, fields, has_body)
        .map_err(|e| ApiError::bad_request(format!("cannot forward this request: {e}")))
}

/// Writes the request head `block` and then `body` (if any) over `io`, and reads the response: the part of
/// [`forward_heads`] after the request head is encoded.
#[allow(clippy::too_many_arguments)]
async fn exchange<IO, B, A, G, F>(
    io: IO,
    accepted: A,
    abort: F,
    block: Bytes,
    body: Option<B>,
    user_upgrade: Option<hyper::upgrade::OnUpgrade>,
    target: Target<'_>,
    guard: G,
) -> Result<Response<Body>, ApiError>
where
    G: Send + 'static,
    IO: ReadChunk + AsyncWrite + Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<BoxError>,
    A: Future<Output = Result<Bytes, TunnelError>>,
    F: Fn() + Clone + Send + 'static,
{
    use tokio::io::AsyncWriteExt as _;

    let upgrade = user_upgrade.is_some();
    let io = heads::SharedStream::new(io);
    let mut writer = io.clone();
    if let Err(e) = writer.write_all(&block).await {
        return Err(write_error(&e, target));
    }
    if let Some(mut body) = body {
        let abort = abort.clone();
        tokio::spawn(async move {
            loop {
                let frame = match body.frame().await {
                    None => break,
                    Some(Ok(frame)) => frame,
                    Some(Err(e)) => {
                        let e: BoxError = e.into();
                        tracing::debug!(error = %e, "the user's request body broke off; cutting the request");
                        abort();
                        return;
                    }
                };
                if let Ok(data) = frame.into_data()
                    && writer.write_all(&data).await.is_err()
                {
                    // The stream failed: the response side reports why.
                    return;
                }
            }
            let _ = writer.shutdown().await;
        });
    } else if !upgrade {
        let _ = writer.shutdown().await;
    }

    let accepted = answer_within(accepted, target);
    let mut reader = io.clone();
    let response = heads::read_block(&mut reader, MAX_RESPONSE_HEAD);
    tokio::pin!(accepted, response);
    let head = async {
        // Set once `accepted` has resolved: it must not be polled again.
        let mut answered = false;
        let read = tokio::select! {
            biased;
            answer = &mut accepted => {
                answered = true;
                match answer {
                    Ok(_) => (&mut response).await,
                    Err(e) => return Err(tunnel_error(e, target)),
                }
            }
            read = &mut response => read,
        };
        match read {
            Ok(Some(block)) => heads::decode_response(block).map_err(|e| head_error(&e, target)),
            failed => {
                // The answer to the OPEN explains a failed exchange better than the stream's error, when it is in.
                if !answered && let Some(Err(te)) = accepted.now_or_never() {
                    return Err(tunnel_error(te, target));
                }
                match failed {
                    Ok(_) => Err(head_error(&heads::BadHead::Truncated, target)),
                    Err(e) => Err(head_error(&e, target)),
                }
            }
        }
    };
    let head = match tokio::time::timeout(target.request_timeout, head).await {
        Ok(head) => head?,
        Err(_) => {
            // The agent sees a reset and cancels the request, whether still queued there or already sent.
            abort();
            return Err(head_timeout(target));
        }
    };
    if head.status == StatusCode::SWITCHING_PROTOCOLS {
        let Some(user_upgrade) = user_upgrade else {
            return Err(ApiError::tunnel(
                StatusCode::BAD_GATEWAY,
                "BadGateway",
                "the cluster answered 101 Switching Protocols to a request that did not ask to upgrade",
            ));
        };
        let cluster = target.cluster.to_owned();
        let headers = head.headers.clone();
        tokio::spawn(async move {
            let _guard = guard;
            match user_upgrade.await {
                Ok(user) => pipe(TokioIo::new(user), io, &headers, &cluster).await,
                Err(e) => {
                    tracing::debug!(cluster = %cluster, error = %e, "the user's side of the upgrade did not complete")
                }
            }
        });
        let mut resp = Response::new(crate::body::empty());
        *resp.status_mut() = head.status;
        *resp.headers_mut() = head.headers;
        // Clients such as kube-rs refuse anything but `Connection: Upgrade` on a 101.
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
        return Ok(resp);
    }
    if upgrade {
        // No pipe after all: our side of the stream is done.
        let mut writer = io.clone();
        let _ = writer.shutdown().await;
    }

    let mut headers = head.headers;
    strip_hop_by_hop(&mut headers, false);
    let length = heads::content_length(&headers);
    let body = heads::BodyReader::new(io, !head.body).with_length(length);
    let mut resp = Response::new(body);
    *resp.status_mut() = head.status;
    *resp.headers_mut() = headers;
    Ok(for_the_user(resp, target))
}

/// A response head that could not be read or made sense of.
fn head_error(e: &heads::BadHead, target: Target<'_>) -> ApiError {
    if let heads::BadHead::Io(io) = e
        && let Some(te) = find_tunnel_error(io)
    {
        return tunnel_error(te.clone(), target);
    }
    ApiError::tunnel(
        StatusCode::BAD_GATEWAY,
        "BadGateway",
        format!(
            "the agent of cluster {} did not return a valid response head: {e}",
            target.cluster
        ),
    )
    .mark_retryable()
}

/// Writing the request head failed: the stream is already gone.
fn write_error(e: &std::io::Error, target: Target<'_>) -> ApiError {
    match find_tunnel_error(e) {
        Some(te) => tunnel_error(te.clone(), target),
        None => ApiError::internal(format!("cannot write to the tunnel stream: {e}")),
    }
}

/// Why a response body stopped before its end, in the user's terms (for a watch's final ERROR event).
pub(crate) fn explain_body_error(cluster: &str, e: &BoxError) -> String {
    let e: &(dyn StdError + 'static) = &**e;
    match find_tunnel_error(e) {
        Some(TunnelError::Closed(why)) => {
            format!(
                "the tunnel to cluster {cluster} was lost (agent gone or connection broken: {why})"
            )
        }
        Some(TunnelError::Reset(c)) if *c == code::SHUTDOWN => {
            format!("the agent of cluster {cluster} is shutting down")
        }
        Some(TunnelError::Reset(c)) => {
            format!("the agent of cluster {cluster} reset the stream (code {c})")
        }
        Some(other) => format!("the tunnel to cluster {cluster} failed: {other}"),
        None => format!("the response from cluster {cluster} broke off: {e}"),
    }
}

/// How long the relay waits, after telling a port-forward's user why its connections ended, for the user to
/// close (kubectl prints the message, then closes): closing first could make it exit before it prints.
const FAREWELL_WAIT: Duration = Duration::from_secs(2);

/// Copies both ways until both directions end, half-close included. When the agent's side breaks (the tunnel
/// is lost, the agent is gone or resets the stream) rather than ending, the user is told why where the
/// protocol allows it before its side is closed: [`ends::websocket_break`] for WebSocket exec and attach, and
/// for port-forwards over SPDY (plain or in a WebSocket) a message on the error stream of every forwarded
/// connection still open ([`spdy::PortForward`], which watches the bytes as they pass).
pub(crate) async fn pipe<U, A>(user: U, agent: A, headers: &HeaderMap, cluster: &str)
where
    U: AsyncRead + AsyncWrite + Unpin,
    A: AsyncRead + AsyncWrite + Unpin,
{
    use tokio::io::AsyncWriteExt as _;
    let port_forward = spdy::PortForward::for_upgrade(headers).map(std::sync::Mutex::new);
    let watch = |f: &dyn Fn(&mut spdy::PortForward)| {
        if let Some(pf) = &port_forward {
            f(&mut pf.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        }
    };
    let (user_read, mut user_write) = tokio::io::split(user);
    let (agent_read, mut agent_write) = tokio::io::split(agent);
    let mut user_read = Observed::new(user_read, |b: &[u8]| watch(&|pf| pf.handle_user_bytes(b)));
    let mut agent_read =
        Observed::new(agent_read, |b: &[u8]| watch(&|pf| pf.handle_agent_bytes(b)));
    // The cause, once a port-forward's user was told it on each connection.
    let mut told: Option<String> = None;
    let (up, down) = {
        let up = async {
            let result = tokio::io::copy(&mut user_read, &mut agent_write).await;
            let _ = agent_write.shutdown().await;
            result
        };
        let down = async {
            let result = tokio::io::copy(&mut agent_read, &mut user_write).await;
            let Err(e) = &result else {
                let _ = user_write.shutdown().await;
                return result;
            };
            let boxed: BoxError = match find_tunnel_error(e) {
                Some(te) => Box::new(te.clone()),
                None => Box::new(std::io::Error::new(e.kind(), e.to_string())),
            };
            let cause = explain_body_error(cluster, &boxed);
            let message = format!("cluster {cluster}: {cause}");
            let farewell = port_forward.as_ref().and_then(|pf| {
                pf.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .farewell(&message)
            });
            if let Some(bytes) = farewell {
                tracing::info!(cluster = %cluster, %cause, "port-forward broke; told the user why on each connection");
                if user_write.write_all(&bytes).await.is_ok() {
                    told = Some(cause);
                }
                // The close waits until the user has read it (below).
                return result;
            }
            if let Some(bytes) = ends::websocket_break(headers, cluster, &cause) {
                tracing::info!(cluster = %cluster, %cause, "upgraded stream broke; told the user why");
                let _ = user_write.write_all(&bytes).await;
            }
            let _ = user_write.shutdown().await;
            result
        };
        tokio::pin!(up, down);
        // A broken agent side ends the pipe (the user's side is told and closed); a clean end of either
        // direction waits for the other (half-close).
        tokio::select! {
            down_result = &mut down => match down_result {
                Err(e) => (None, Err(e)),
                Ok(n) => (Some(up.await), Ok(n)),
            },
            up_result = &mut up => (Some(up_result), down.await),
        }
    };
    if let Some(cause) = told {
        // kubectl prints each connection's message, then closes the session; wait (bounded) for that, then
        // close our side the way a WebSocket closes.
        let drained = tokio::time::timeout(FAREWELL_WAIT, async {
            let mut sink = [0u8; 4096];
            while let Ok(n) = tokio::io::AsyncReadExt::read(&mut user_read, &mut sink).await {
                if n == 0 {
                    break;
                }
            }
        })
        .await;
        if drained.is_err() {
            tracing::debug!(cluster = %cluster, "the port-forward's user did not close after being told");
        }
        // Port-forward's WebSocket gets only its close frame here (no exec error channel).
        if let Some(bytes) = ends::websocket_break(headers, cluster, &cause) {
            let _ = user_write.write_all(&bytes).await;
        }
        let _ = user_write.shutdown().await;
    }
    match (up, down) {
        (Some(Ok(up)), Ok(down)) => {
            tracing::debug!(cluster = %cluster, up, down, "upgraded stream finished")
        }
        (up, down) => tracing::debug!(
            cluster = %cluster,
            up = ?up.and_then(Result::err),
            down = ?down.err(),
            "upgraded stream ended with an error"
        ),
    }
}

/// A reader that shows every byte it reads to `observe` (the bytes are not changed).
struct Observed<R, F> {
    inner: R,
    observe: F,
}

impl<R, F> Observed<R, F> {
    fn new(inner: R, observe: F) -> Self {
        Self { inner, observe }
    }
}

impl<R: AsyncRead + Unpin, F: FnMut(&[u8]) + Unpin> AsyncRead for Observed<R, F> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        let result = std::pin::Pin::new(&mut this.inner).poll_read(cx, buf);
        if let std::task::Poll::Ready(Ok(())) = &result
            && buf.filled().len() > before
        {
            (this.observe)(&buf.filled()[before..]);
        }
        result
    }
}

/// HTTP/1.1 `Connection: upgrade` + `Upgrade: …` (kubectl exec/attach/port-forward, WebSocket, SPDY).
pub(crate) fn is_upgrade_request<B>(req: &Request<B>) -> bool {
    req.version() <= Version::HTTP_11
        && req.headers().contains_key(header::UPGRADE)
        && connection_tokens(req.headers()).any(|t| t.eq_ignore_ascii_case("upgrade"))
}

fn connection_tokens(headers: &HeaderMap) -> impl Iterator<Item = &str> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|t| !t.is_empty())
}

/// Removes hop-by-hop headers, including those the `Connection` header names. For an upgrade request,
/// `Upgrade` and `Connection: upgrade` stay (they are what asks the far end to switch).
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap, keep_upgrade: bool) {
    let named: Vec<HeaderName> = connection_tokens(headers)
        .filter(|t| !(keep_upgrade && t.eq_ignore_ascii_case("upgrade")))
        .filter_map(|t| HeaderName::from_bytes(t.as_bytes()).ok())
        .collect();
    // One pass over the names the message has (usually none of these) instead of a hashed removal of each
    // name it might have: that was ~2,800 instructions per request.
    let doomed: Vec<HeaderName> = headers
        .keys()
        .filter(|name| {
            HOP_BY_HOP.contains(name)
                || named.contains(name)
                || (!keep_upgrade && *name == header::UPGRADE)
        })
        .cloned()
        .collect();
    for name in &doomed {
        headers.remove(name);
    }
    if keep_upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    }
}

fn outgoing_request<B>(
    req: Request<B>,
    target: Target<'_>,
    upgrade: bool,
) -> Result<Request<B>, ApiError> {
    let (mut parts, body) = req.into_parts();
    let uri: Uri = target.path_and_query.parse().map_err(|e| {
        ApiError::bad_request(format!(
            "invalid request path {:?}: {e}",
            target.path_and_query
        ))
    })?;
    let host = HeaderValue::from_str(target.cluster)
        .map_err(|_| ApiError::bad_request(format!("invalid cluster name {:?}", target.cluster)))?;
    parts.uri = uri;
    parts.version = Version::HTTP_11;
    strip_hop_by_hop(&mut parts.headers, upgrade);
    parts.headers.insert(header::HOST, host);
    // Extensions belong to the incoming connection (e.g. its upgrade handle), not to the outgoing one.
    parts.extensions = http::Extensions::new();
    Ok(Request::from_parts(parts, body))
}

/// The first [`TunnelError`] in an error's chain (the tunnel stream reports its failures as
/// `io::Error::other(TunnelError)`).
fn find_tunnel_error<'a>(e: &'a (dyn StdError + 'static)) -> Option<&'a TunnelError> {
    let mut cur: Option<&(dyn StdError + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(te) = err.downcast_ref::<TunnelError>() {
            return Some(te);
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && let Some(inner) = io.get_ref()
            && let Some(te) = inner.downcast_ref::<TunnelError>()
        {
            return Some(te);
        }
        cur = err.source();
    }
    None
}

fn response_error(e: &hyper::Error, target: Target<'_>) -> ApiError {
    if let Some(te) = find_tunnel_error(e) {
        return tunnel_error(te.clone(), target);
    }
    ApiError::tunnel(
        StatusCode::BAD_GATEWAY,
        "BadGateway",
        format!(
            "the agent of cluster {} did not return a valid HTTP response: {e}",
            target.cluster
        ),
    )
    .mark_retryable()
}

/// The response head did not arrive within the request timeout.
fn head_timeout(target: Target<'_>) -> ApiError {
    ApiError::tunnel(
        StatusCode::GATEWAY_TIMEOUT,
        "Timeout",
        format!(
            "cluster {} did not answer within the request timeout ({:?})",
            target.cluster, target.request_timeout
        ),
    )
    .mark_retryable()
}

/// How a tunnel failure looks to the user.
pub(crate) fn tunnel_error(e: TunnelError, target: Target<'_>) -> ApiError {
    let cluster = target.cluster;
    match e {
        TunnelError::Refused {
            code: code::REFUSED_TOO_MANY_STREAMS,
            ..
        }
        | TunnelError::TooManyStreams => ApiError::tunnel(
            StatusCode::TOO_MANY_REQUESTS,
            "TooManyRequests",
            format!("too many concurrent requests to cluster {cluster} through the relay"),
        )
        .retry_after(Duration::from_secs(1)),
        // The agent is shedding load (its users opened and cancelled streams faster than it serves them): the
        // tunnel stays up and the request can come back in a moment, as from kube-apiserver's own overload
        // protection (429 with Retry-After, which client-go and kubectl retry).
        TunnelError::Refused {
            code: code::OVERLOADED,
            ..
        } => ApiError::tunnel(
            StatusCode::TOO_MANY_REQUESTS,
            "TooManyRequests",
            format!(
                "the agent of cluster {cluster} is shedding load for a moment (too many requests were \
                 cancelled right after they were sent); retry shortly"
            ),
        )
        .retry_after(Duration::from_secs(1)),
        TunnelError::Refused {
            code: code::SHUTDOWN,
            reason,
        } => ApiError::tunnel(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            format!("the agent of cluster {cluster} is shutting down: {reason}"),
        )
        .retry_after(Duration::from_secs(1))
        .mark_tunnel_gone(),
        TunnelError::Refused { reason, code } => ApiError::tunnel(
            StatusCode::BAD_GATEWAY,
            "BadGateway",
            format!("the agent of cluster {cluster} refused the request (code {code}): {reason}"),
        ),
        TunnelError::TimedOut(_) => ApiError::tunnel(
            StatusCode::GATEWAY_TIMEOUT,
            "Timeout",
            format!(
                "the agent of cluster {cluster} did not answer within {:?}",
                target.open_timeout
            ),
        )
        .mark_retryable(),
        TunnelError::Reset(code) => {
            let e = ApiError::tunnel(
                StatusCode::BAD_GATEWAY,
                "BadGateway",
                format!("the agent of cluster {cluster} reset the request stream (code {code})"),
            )
            .mark_retryable();
            if code == code::SHUTDOWN {
                e.mark_tunnel_gone()
            } else {
                e
            }
        }
        TunnelError::Closed(why) => ApiError::tunnel(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            format!("the tunnel to cluster {cluster} closed: {why}"),
        )
        .mark_retryable()
        .mark_tunnel_gone(),
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::{Arc, Mutex};

    use http_body_util::{BodyExt, Full, StreamBody};
    use hyper::body::{Frame, Incoming};
    use hyper::service::service_fn;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
    use tokio::sync::mpsc;

    use super::*;

    type Seen = Arc<Mutex<Vec<Request<()>>>>;

    #[test]
    fn hop_by_hop_headers_go_and_the_rest_stay() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("x-hop, Upgrade"),
        );
        h.insert("x-hop", HeaderValue::from_static("1"));
        h.append("keep-alive", HeaderValue::from_static("timeout=5"));
        h.append("keep-alive", HeaderValue::from_static("max=9"));
        h.insert(header::TE, HeaderValue::from_static("trailers"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer t"));
        h.insert("x-kept", HeaderValue::from_static("2"));

        let mut plain = h.clone();
        strip_hop_by_hop(&mut plain, false);
        let mut names: Vec<&str> = plain.keys().map(HeaderName::as_str).collect();
        names.sort_unstable();
        assert_eq!(names, ["authorization", "x-kept"]);

        let mut upgrade = h;
        strip_hop_by_hop(&mut upgrade, true);
        let mut names: Vec<&str> = upgrade.keys().map(HeaderName::as_str).collect();
        names.sort_unstable();
        assert_eq!(names, ["authorization", "connection", "upgrade", "x-kept"]);
        assert_eq!(upgrade[header::CONNECTION], "upgrade");
        assert_eq!(upgrade[header::UPGRADE], "websocket");
    }

    /// The head block carries the same fields an edited copy of the user's headers would: hop-by-hop ones
    /// gone (those `Connection` names too), a forged `Host` replaced by the cluster's name, nothing else touched.
    #[test]
    fn the_head_is_encoded_as_the_stripped_copy_would_be() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("x-hop, Upgrade"),
        );
        h.insert("x-hop", HeaderValue::from_static("1"));
        h.append("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(header::TE, HeaderValue::from_static("trailers"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        h.insert(header::HOST, HeaderValue::from_static("elsewhere.example"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer t"));
        h.append("x-kept", HeaderValue::from_static("2"));
        h.append("x-kept", HeaderValue::from_static("3"));
        let mut req = Request::new(());
        *req.method_mut() = http::Method::GET;
        *req.headers_mut() = h;
        let (parts, ()) = req.into_parts();

        for upgrade in [false, true] {
            let block = encode_head(&parts, target(), upgrade, false).expect("encodes");
            let head = heads::decode_request(block.slice(4..)).expect("decodes");
            let mut expected = parts.headers.clone();
            strip_hop_by_hop(&mut expected, upgrade);
            expected.insert(header::HOST, HeaderValue::from_static("prod"));
            assert_eq!(head.headers, expected, "upgrade: {upgrade}");
            assert_eq!(head.target, "/api/v1/pods?watch=1");
            assert_eq!(head.method, http::Method::GET);
            assert!(!head.body);
        }

        for path in [
            "api/v1/pods",
            "/api/v1/po ds",
            "/api/v1/pods\r\nX-Injected: 1",
            "",
        ] {
            let bad = Target {
                path_and_query: path,
                ..target()
            };
            let err = encode_head(&parts, bad, false, false).expect_err(path);
            assert_eq!(err.status, StatusCode::BAD_REQUEST, "{path:?}");
        }
    }

    fn target() -> Target<'static> {
        Target {
            cluster: "prod",
            path_and_query: "/api/v1/pods?watch=1",
            open_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(60),
            watches_end: None,
        }
    }

    /// Serves HTTP/1.1 on `io` like an agent's apiserver would, with `handler`.
    fn serve_agent<F, Fut>(io: DuplexStream, handler: F)
    where
        F: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Response<Body>> + Send + 'static,
    {
        let handler = Arc::new(handler);
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let handler = handler.clone();
                async move { Ok::<_, Infallible>(handler(req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(io), svc)
                .with_upgrades()
                .await;
        });
    }

    fn ok() -> impl Future<Output = Result<Bytes, TunnelError>> {
        std::future::ready(Ok(Bytes::new()))
    }

    #[tokio::test]
    async fn rewrites_path_and_headers() -> anyhow::Result<()> {
        let (relay_side, agent_side) = tokio::io::duplex(64 * 1024);
        let seen: Seen = Arc::default();
        let seen2 = seen.clone();
        serve_agent(agent_side, move |req| {
            let seen = seen2.clone();
            async move {
                let (parts, body) = req.into_parts();
                let body = body
                    .collect()
                    .await
                    .map(|c| c.to_bytes())
                    .unwrap_or_default();
                seen.lock()
                    .map(|mut s| s.push(Request::from_parts(parts, ())))
                    .ok();
                let mut resp = Response::new(crate::body::full(body));
                resp.headers_mut()
                    .insert("x-from-agent", HeaderValue::from_static("yes"));
                resp.headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("x-secret-hop"));
                resp.headers_mut()
                    .insert("x-secret-hop", HeaderValue::from_static("1"));
                resp
            }
        });
        let req = Request::builder()
            .method("POST")
            .uri("https://relay.example/clusters/prod/api/v1/pods?watch=1")
            .version(Version::HTTP_2)
            .header(header::AUTHORIZATION, "Bearer user-token")
            .header(header::CONNECTION, "keep-alive, x-custom-hop")
            .header("x-custom-hop", "drop me")
            .header("keep-alive", "timeout=5")
            .header(header::TE, "trailers")
            .header(header::PROXY_AUTHORIZATION, "Basic abc")
            .header(header::HOST, "relay.example")
            .header("x-kept", "kept")
            .body(Full::new(Bytes::from_static(b"{\"hello\":1}")))?;
        let resp = forward(relay_side, ok(), req, target(), ())
            .await
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(resp.headers()["x-from-agent"], "yes");
        assert!(resp.headers().get("x-secret-hop").is_none());
        assert!(resp.headers().get(header::CONNECTION).is_none());
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .to_bytes();
        assert_eq!(&body[..], b"{\"hello\":1}");

        let seen = seen.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
        let got = seen
            .first()
            .ok_or_else(|| anyhow::anyhow!("agent saw no request"))?;
        assert_eq!(got.method(), "POST");
        assert_eq!(got.uri(), "/api/v1/pods?watch=1");
        assert_eq!(got.version(), Version::HTTP_11);
        assert_eq!(got.headers()[header::HOST], "prod");
        assert_eq!(got.headers()[header::AUTHORIZATION], "Bearer user-token");
        assert_eq!(got.headers()["x-kept"], "kept");
        for gone in [
            "x-custom-hop",
            "keep-alive",
            "te",
            "proxy-authorization",
            "upgrade",
        ] {
            assert!(got.headers().get(gone).is_none(), "{gone} was forwarded");
        }
        Ok(())
    }

    #[tokio::test]
    async fn streams_a_chunked_response_incrementally() -> anyhow::Result<()> {
        let (relay_side, agent_side) = tokio::io::duplex(64 * 1024);
        // The agent sends a chunk, then waits for the test to ask for the next one: the first chunk must
        // reach the user while the response is still open (a watch).
        let (next_tx, next_rx) = mpsc::channel::<Bytes>(1);
        let next_rx = Arc::new(tokio::sync::Mutex::new(Some(next_rx)));
        serve_agent(agent_side, move |_req| {
            let next_rx = next_rx.clone();
            async move {
                let rx = next_rx.lock().await.take();
                let stream = futures_util::stream::unfold(rx, |rx| async move {
                    let mut rx = rx?;
                    let chunk = rx.recv().await?;
                    Some((Ok::<_, BoxError>(Frame::data(chunk)), Some(rx)))
                });
                Response::new(BodyExt::boxed(StreamBody::new(stream)))
            }
        });
        let req = Request::builder()
            .uri("/clusters/prod/api/v1/pods?watch=1")
            .body(http_body_util::Empty::<Bytes>::new())?;
        let resp = forward(relay_side, ok(), req, target(), ())
            .await
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        assert!(resp.headers().get(header::TRANSFER_ENCODING).is_none());
        let mut body = resp.into_body();
        for i in 0..3 {
            let line = Bytes::from(format!("{{\"type\":\"ADDED\",\"n\":{i}}}\n"));
            next_tx.send(line.clone()).await?;
            let frame = body
                .frame()
                .await
                .ok_or_else(|| anyhow::anyhow!("body ended early"))?;
            let data = frame
                .map_err(|e| anyhow::anyhow!("{e}"))?
                .into_data()
                .map_err(|_| anyhow::anyhow!("not data"))?;
            assert_eq!(data, line);
        }
        drop(next_tx);
        assert!(
            body.frame().await.is_none(),
            "body ends when the agent ends it"
        );
        Ok(())
    }

    #[tokio::test]
    async fn refused_and_timed_out_streams_map_to_502_and_504() -> anyhow::Result<()> {
        let (relay_side, _agent_side) = tokio::io::duplex(1024);
        let refused = std::future::ready(Err(TunnelError::Refused {
            code: code::REFUSED,
            reason: "forbidden".into(),
        }));
        let req = Request::builder()
            .uri("/x")
            .body(http_body_util::Empty::<Bytes>::new())?;
        let err = forward(relay_side, refused, req, target(), ())
            .await
            .err()
            .ok_or_else(|| anyhow::anyhow!("no error"))?;
        assert_eq!(err.status, StatusCode::BAD_GATEWAY);
        assert!(err.message.contains("forbidden"), "{}", err.message);

        let (relay_side, _agent_side) = tokio::io::duplex(1024);
        let timed_out = std::future::ready(Err(TunnelError::TimedOut(Duration::from_secs(10))));
        let req = Request::builder()
            .uri("/x")
            .body(http_body_util::Empty::<Bytes>::new())?;
        let err = forward(relay_side, timed_out, req, target(), ())
            .await
            .err()
            .ok_or_else(|| anyhow::anyhow!("no error"))?;
        assert_eq!(err.status, StatusCode::GATEWAY_TIMEOUT);
        assert!(
            err.message.contains("did not answer within 10s"),
            "{}",
            err.message
        );

        let (relay_side, _agent_side) = tokio::io::duplex(1024);
        let busy = std::future::ready(Err(TunnelError::TooManyStreams));
        let req = Request::builder()
            .uri("/x")
            .body(http_body_util::Empty::<Bytes>::new())?;
        let err = forward(relay_side, busy, req, target(), ())
            .await
            .err()
            .ok_or_else(|| anyhow::anyhow!("no error"))?;
        assert_eq!(err.status, StatusCode::TOO_MANY_REQUESTS);
        assert!(err.retry_after.is_some());

        // An agent that sheds load: 429 with Retry-After, never a 502.
        let (relay_side, _agent_side) = tokio::io::duplex(1024);
        let shedding = std::future::ready(Err(TunnelError::Refused {
            code: code::OVERLOADED,
            reason: "shedding load".into(),
        }));
        let req = Request::builder()
            .uri("/x")
            .body(http_body_util::Empty::<Bytes>::new())?;
        let err = forward(relay_side, shedding, req, target(), ())
            .await
            .err()
            .ok_or_else(|| anyhow::anyhow!("no error"))?;
        assert_eq!(err.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(err.retry_after, Some(Duration::from_secs(1)));
        assert!(err.message.contains("shedding load"), "{}", err.message);
        Ok(())
    }

    #[tokio::test(start_paused = true)]
    async fn a_lost_accept_still_ends_in_504() -> anyhow::Result<()> {
        // Safety net: even if the tunnel never answered, the request does not hang (virtual time).
        let (relay_side, _agent_side) = tokio::io::duplex(1024);
        let req = Request::builder()
            .uri("/x")
            .body(http_body_util::Empty::<Bytes>::new())?;
        let never = std::future::pending::<Result<Bytes, TunnelError>>();
        let err = forward(relay_side, never, req, target(), ())
            .await
            .err()
            .ok_or_else(|| anyhow::anyhow!("no error"))?;
        assert_eq!(err.status, StatusCode::GATEWAY_TIMEOUT);
        Ok(())
    }

    #[tokio::test(start_paused = true)]
    async fn a_response_head_that_never_comes_is_504_and_the_stream_is_dropped()
    -> anyhow::Result<()> {
        // The agent accepts and reads the request but never answers (virtual time).
        let (relay_side, mut agent_side) = tokio::io::duplex(64 * 1024);
        let reader = tokio::spawn(async move {
            let mut sink = Vec::new();
            // Ends once the relay gives up and drops its end of the stream.
            let _ = agent_side.read_to_end(&mut sink).await;
            sink
        });
        let req = Request::builder()
            .uri("/clusters/prod/api/v1/pods")
            .body(http_body_util::Empty::<Bytes>::new())?;
        let mut t = target();
        t.request_timeout = Duration::from_secs(3);
        let err = forward(relay_side, ok(), req, t, ())
            .await
            .err()
            .ok_or_else(|| anyhow::anyhow!("no error"))?;
        assert_eq!(err.status, StatusCode::GATEWAY_TIMEOUT);
        assert!(err.message.contains("cluster prod"), "{}", err.message);
        assert!(err.message.contains("3s"), "{}", err.message);
        let seen = tokio::time::timeout(Duration::from_secs(5), reader).await??;
        assert!(seen.starts_with(b"GET /api/v1/pods"));
        Ok(())
    }

    #[tokio::test]
    async fn agent_closing_without_answer_is_502() -> anyhow::Result<()> {
        let (relay_side, agent_side) = tokio::io::duplex(1024);
        drop(agent_side);
        let req = Request::builder()
            .uri("/x")
            .body(http_body_util::Empty::<Bytes>::new())?;
        let err = forward(relay_side, ok(), req, target(), ())
            .await
            .err()
            .ok_or_else(|| anyhow::anyhow!("no error"))?;
        assert_eq!(err.status, StatusCode::BAD_GATEWAY);
        Ok(())
    }

    #[test]
    fn tunnel_errors_found_in_io_chains() {
        let io = std::io::Error::from(TunnelError::Reset(8));
        assert!(matches!(
            find_tunnel_error(&io),
            Some(TunnelError::Reset(8))
        ));
        let plain = std::io::Error::other("nope");
        assert!(find_tunnel_error(&plain).is_none());
    }

    /// The full upgrade path needs a real user-side connection (hyper's upgrade handle lives in the
    /// incoming request): user client ⇄ duplex ⇄ hyper server calling `forward` ⇄ duplex ⇄ agent server.
    #[tokio::test]
    async fn upgrade_becomes_a_byte_pipe_with_half_close() -> anyhow::Result<()> {
        let (relay_side, agent_side) = tokio::io::duplex(64 * 1024);
        serve_agent(agent_side, |mut req| async move {
            assert!(is_upgrade_request(&req));
            let on = hyper::upgrade::on(&mut req);
            tokio::spawn(async move {
                let Ok(upgraded) = on.await else { return };
                let mut io = TokioIo::new(upgraded);
                // Echo everything upper-cased until the user half-closes, then say goodbye and close.
                let mut all = Vec::new();
                let _ = io.read_to_end(&mut all).await;
                let _ = io.write_all(&all.to_ascii_uppercase()).await;
                let _ = io.write_all(b"|bye").await;
                let _ = io.shutdown().await;
            });
            let mut resp = Response::new(crate::body::empty());
            *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
            resp.headers_mut()
                .insert(header::UPGRADE, HeaderValue::from_static("SPDY/3.1"));
            resp.headers_mut().insert(
                "x-stream-protocol-version",
                HeaderValue::from_static("v4.channel.k8s.io"),
            );
            resp
        });

        // The relay's user-facing side.
        let (user_side, relay_server_side) = tokio::io::duplex(64 * 1024);
        let relay_io = Arc::new(Mutex::new(Some(relay_side)));
        tokio::spawn(async move {
            let svc = service_fn(move |req: Request<Incoming>| {
                let io = relay_io.lock().ok().and_then(|mut g| g.take());
                async move {
                    let Some(io) = io else {
                        return Ok::<_, Infallible>(Response::new(crate::body::empty()));
                    };
                    Ok(forward(io, ok(), req, target(), ())
                        .await
                        .unwrap_or_else(ApiError::into_response))
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(relay_server_side), svc)
                .with_upgrades()
                .await;
        });

        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(user_side)).await?;
        tokio::spawn(conn.with_upgrades());
        let req = Request::builder()
            .uri("/clusters/prod/api/v1/namespaces/default/pods/p/exec?command=sh")
            .header(header::HOST, "relay")
            .header(header::CONNECTION, "Upgrade")
            .header(header::UPGRADE, "SPDY/3.1")
            .header("x-stream-protocol-version", "v4.channel.k8s.io")
            .body(http_body_util::Empty::<Bytes>::new())?;
        let resp = sender.send_request(req).await?;
        assert_eq!(resp.status(), StatusCode::SWITCHING_PROTOCOLS);
        assert_eq!(resp.headers()[header::UPGRADE], "SPDY/3.1");
        assert_eq!(
            resp.headers()["x-stream-protocol-version"],
            "v4.channel.k8s.io"
        );
        let mut io = TokioIo::new(hyper::upgrade::on(resp).await?);
        let payload: Vec<u8> = (0..=255u8)
            .cycle()
            .take(100_000)
            .map(|b| b & 0x7f)
            .collect();
        io.write_all(&payload).await?;
        io.shutdown().await?; // half-close: the agent sees EOF, and can still answer
        let mut back = Vec::new();
        io.read_to_end(&mut back).await?;
        let mut expected = payload.to_ascii_uppercase();
        expected.extend_from_slice(b"|bye");
        assert_eq!(back.len(), expected.len());
        assert!(back == expected, "bytes changed on the way");
        Ok(())
    }

    /// Reads the request head and body an agent would see on a stream of kind `HTTP_HEADS`.
    async fn read_request(io: &mut DuplexStream) -> anyhow::Result<(heads::RequestHead, Vec<u8>)> {
        let block = heads::read_block(io, 64 * 1024)
            .await?
            .ok_or_else(|| anyhow::anyhow!("no head"))?;
        let head = heads::decode_request(block)?;
        let mut body = Vec::new();
        if head.body {
            io.read_to_end(&mut body).await?;
        }
        Ok((head, body))
    }

    fn no_abort() {}

    #[tokio::test]
    async fn heads_carry_the_rewritten_request_and_the_response_without_http1() -> anyhow::Result<()>
    {
        let (relay_side, mut agent_side) = tokio::io::duplex(64 * 1024);
        let agent = tokio::spawn(async move {
            let (head, body) = read_request(&mut agent_side).await?;
            // The relay finished its side after the body.
            let mut rest = Vec::new();
            agent_side.read_to_end(&mut rest).await?;
            let mut headers = HeaderMap::new();
            headers.insert("x-from-agent", HeaderValue::from_static("yes"));
            headers.insert(header::CONNECTION, HeaderValue::from_static("x-secret-hop"));
            headers.insert("x-secret-hop", HeaderValue::from_static("1"));
            let block = heads::encode_response(StatusCode::CREATED, &headers, true)?;
            agent_side.write_all(&block).await?;
            agent_side.write_all(b"created: ").await?;
            agent_side.write_all(&body).await?;
            agent_side.shutdown().await?;
            anyhow::Ok((head, rest))
        });
        let req = Request::builder()
            .method("POST")
            .uri("/clusters/prod/api/v1/pods?watch=1")
            .header("authorization", "Bearer t")
            .header(header::CONNECTION, "keep-alive, x-user-hop")
            .header("x-user-hop", "1")
            .header(header::TRANSFER_ENCODING, "chunked")
            .body(Full::new(Bytes::from_static(b"{\"a\":1}")))?;
        let resp = forward_heads(relay_side, ok(), no_abort, req, target(), ())
            .await
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        assert_eq!(resp.status(), StatusCode::CREATED);
        assert_eq!(resp.headers()["x-from-agent"], "yes");
        assert!(resp.headers().get("x-secret-hop").is_none());
        assert!(resp.headers().get(header::CONNECTION).is_none());
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| anyhow::anyhow!(e))?;
        assert_eq!(&body.to_bytes()[..], b"created: {\"a\":1}");
        let (head, rest) = agent.await??;
        assert_eq!(head.method, http::Method::POST);
        assert_eq!(head.target, "/api/v1/pods?watch=1");
        assert!(head.body);
        assert!(rest.is_empty());
        assert_eq!(head.headers[header::HOST], "prod");
        assert_eq!(head.headers[header::AUTHORIZATION], "Bearer t");
        for hop in ["x-user-hop", "connection", "transfer-encoding"] {
            assert!(head.headers.get(hop).is_none(), "{hop} was forwarded");
        }
        Ok(())
    }

    #[tokio::test]
    async fn heads_without_a_body_say_so_and_finish_at_once() -> anyhow::Result<()> {
        let (relay_side, mut agent_side) = tokio::io::duplex(64 * 1024);
        let agent = tokio::spawn(async move {
            let (head, _) = read_request(&mut agent_side).await?;
            let mut rest = Vec::new();
            agent_side.read_to_end(&mut rest).await?;
            let block = heads::encode_response(StatusCode::NO_CONTENT, &HeaderMap::new(), false)?;
            agent_side.write_all(&block).await?;
            agent_side.shutdown().await?;
            anyhow::Ok((head, rest))
        });
        let req = Request::get("/x").body(http_body_util::Empty::<Bytes>::new())?;
        let resp = forward_heads(relay_side, ok(), no_abort, req, target(), ())
            .await
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        assert_eq!(resp.status(), StatusCode::NO_CONTENT);
        assert!(http_body::Body::is_end_stream(resp.body()));
        let (head, rest) = agent.await??;
        assert!(!head.body);
        assert!(rest.is_empty());
        Ok(())
    }

    #[tokio::test]
    async fn an_invalid_or_missing_response_head_is_a_502_naming_the_cluster() -> anyhow::Result<()>
    {
        for answer in [
            &b"\0\0\0\x03\0\x00\xc8"[..], // status 200, then the field count is missing
            &b"\0\0\0\x05\0\x00\x05\0\0"[..], // status 5
            &b"HTTP/1.1 200 OK\r\n\r\n"[..], // HTTP/1.1 text: a length of 1.2 GB
            &b""[..],                     // the stream ends before any head
        ] {
            let (relay_side, mut agent_side) = tokio::io::duplex(64 * 1024);
            tokio::spawn(async move {
                let _ = read_request(&mut agent_side).await;
                let _ = agent_side.write_all(answer).await;
                let _ = agent_side.shutdown().await;
                let mut sink = Vec::new();
                let _ = agent_side.read_to_end(&mut sink).await;
            });
            let req = Request::get("/x").body(http_body_util::Empty::<Bytes>::new())?;
            let err = forward_heads(relay_side, ok(), no_abort, req, target(), ())
                .await
                .err()
                .ok_or_else(|| anyhow::anyhow!("{answer:?} was taken as a response"))?;
            assert_eq!(err.status, StatusCode::BAD_GATEWAY, "{answer:?}");
            assert!(err.message.contains("cluster prod"), "{}", err.message);
        }
        Ok(())
    }

    #[tokio::test]
    async fn a_response_head_that_never_comes_is_a_504_and_the_stream_is_aborted()
    -> anyhow::Result<()> {
        let (relay_side, _agent_side) = tokio::io::duplex(64 * 1024);
        let aborted = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = aborted.clone();
        let abort = move || flag.store(true, std::sync::atomic::Ordering::SeqCst);
        let req = Request::get("/x").body(http_body_util::Empty::<Bytes>::new())?;
        let target = Target {
            request_timeout: Duration::from_millis(50),
            ..target()
        };
        let err = forward_heads(relay_side, ok(), abort, req, target, ())
            .await
            .err()
            .ok_or_else(|| anyhow::anyhow!("answered"))?;
        assert_eq!(err.status, StatusCode::GATEWAY_TIMEOUT);
        assert!(aborted.load(std::sync::atomic::Ordering::SeqCst));
        Ok(())
    }
}

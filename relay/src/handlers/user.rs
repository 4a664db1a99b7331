//! The user endpoint: `/clusters/NAME/…` forwarded over NAME's tunnel.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tether_tunnel::{OpenOptions, Priority, TunnelError, code, kind};

use crate::api_error::ApiError;
use crate::body::{Body, BoxError};
use crate::forward::{self, Target};
use crate::quota::{Principal, Refusal, StreamSlot};
use crate::registry::Tunnel;
use crate::state::{ConnCtx, Shared};
use crate::{auth, entra, peer_forward, user_headers};

/// Handles `/clusters/{rest}` where `rest` is `NAME` or `NAME/…`. Refuses at once — before anything enters a
/// tunnel — without a plausible credential (not exactly one `Authorization: Bearer TOKEN68`) or with an
/// Entra-style token that does not validate (401), for an unknown cluster (404) or one without a tunnel (503).
/// Hop-by-hop and forged identity headers are removed first ([`user_headers::sanitize`]).
pub(crate) async fn handle(
    shared: &Shared,
    ctx: ConnCtx,
    mut req: Request<Incoming>,
    rest: &str,
) -> Result<Response<Body>, ApiError> {
    // The path after the cluster's name, without its leading `/`.
    let (name, path) = rest.split_once('/').unwrap_or((rest, ""));
    // Hop-by-hop and forged identity headers go before the check, so nothing removes a checked header.
    user_headers::sanitize(req.headers_mut(), &ctx.forwarded_for);
    let token = user_headers::plausible_bearer(req.headers())
        .map_err(|e| ApiError::unauthorized(e.to_string()))?;
    let mut principal = Principal::of_credential(token);
    if let Some(authenticator) = &shared.entra
        && let Some(oid) = entra::check(authenticator, req.headers())
            .await
            .map_err(|e| ApiError::unauthorized(e.to_string()))?
    {
        principal = Principal::of_subject(&oid);
    }
    if !auth::valid_cluster_name(name) {
        return Err(ApiError::cluster_not_found(name));
    }
    // The connection counts for the principal of its first request; over the principal's bound this request
    // is refused and an HTTP/1.1 connection closed (an HTTP/2 one asks again with its next request).
    if let Err(r) = count_connection(shared, &ctx, &principal) {
        tracing::debug!(cluster = name, peer = %ctx.peer, bound = r.what, "client over its bound");
        let mut resp = ApiError::client_over_bound(r.what, name, r.retry_after).into_response();
        if req.version() <= http::Version::HTTP_11 {
            resp.headers_mut().insert(
                http::header::CONNECTION,
                http::HeaderValue::from_static("close"),
            );
        }
        return Ok(resp);
    }
    // The registry answers for clusters connected here without touching the store on the hot path; deleting
    // a cluster removes its tunnels, so a registered tunnel implies the cluster exists. Without a usable tunnel
    // here, a replica that holds one serves the request over the peer link.
    let tunnels = shared.registry.usable(name);
    let peers = if tunnels.is_empty() {
        let candidates = peer_forward::candidates(shared, name).await?;
        if candidates.is_empty() {
            return Err(no_tunnel(shared, name).await);
        }
        candidates
    } else {
        Vec::new()
    };
    let path_and_query = {
        let query = req.uri().query();
        let mut pq = String::with_capacity(2 + path.len() + query.map_or(0, str::len));
        pq.push('/');
        pq.push_str(path);
        if let Some(q) = query {
            pq.push('?');
            pq.push_str(q);
        }
        pq
    };
    let target = Target {
        cluster: name,
        path_and_query: &path_and_query,
        open_timeout: shared.config.open_timeout,
        request_timeout: shared.config.request_timeout,
        watches_end: Some(&shared.watches_end),
    };
    // Per-client bounds: only this principal or address is refused; the slot lives as long as the response.
    let slot = shared
        .quotas
        .admit(&principal, ctx.peer.ip(), name, Instant::now())
        .map_err(|r| {
            tracing::debug!(cluster = name, peer = %ctx.peer, bound = r.what, "client over its bound");
            ApiError::client_over_bound(r.what, name, r.retry_after)
        })?;
    let resp = if tunnels.is_empty() {
        tracing::debug!(cluster = name, method = %req.method(), path = req.uri().path(), "forwarding to a peer");
        slot.arm();
        let slot = Arc::new(slot);
        let guard = (ctx.permit, ctx.principal, Arc::clone(&slot));
        let resp = peer_forward::forward(shared, peers, req, target, guard).await;
        (resp, slot)
    } else if is_safe_and_bodyless(&req) {
        // From here on, the user dropping the request before it completes is a cancellation.
        slot.arm();
        let slot = Arc::new(slot);
        let guard = (ctx.permit, ctx.principal, Arc::clone(&slot));
        let (parts, _) = req.into_parts();
        let resp = match forward_safe(shared, &tunnels, &parts, target, guard.clone()).await {
            // Every tunnel here went away under it (this replica drains, the agent moved them): a replica
            // holding the cluster's new tunnel takes it.
            Err(e) if e.tunnel_gone => match peer_forward::candidates(shared, name).await {
                Ok(peers) if !peers.is_empty() => {
                    tracing::debug!(
                        cluster = name,
                        "the tunnels here went away under a safe request; forwarding to a peer"
                    );
                    peer_forward::forward(shared, peers, again(&parts), target, guard).await
                }
                _ => Err(e),
            },
            resp => resp,
        };
        (resp, slot)
    } else {
        let (stream, tunnel) = open_stream(shared, &tunnels, target)?;
        let target = Target {
            watches_end: Some(&tunnel.info.gone),
            ..target
        };
        tracing::debug!(cluster = name, method = %req.method(), path = req.uri().path(), stream = ?stream.id(), "forwarding");
        // From here on, the user dropping the request before it completes is a cancellation.
        slot.arm();
        let slot = Arc::new(slot);
        let guard = (ctx.permit, ctx.principal, Arc::clone(&slot));
        let heads = tunnel.info.http_heads();
        (
            forward_stream(stream, heads, req, target, guard).await,
            slot,
        )
    };
    let (resp, slot) = resp;
    let resp = match resp {
        Ok(resp) => resp,
        Err(e) => {
            // The relay or the cluster ended it, not the user.
            slot.finish();
            return Err(e);
        }
    };
    Ok(resp.map(|body| Holding { body, slot }.boxed()))
}

/// Why a cluster with no usable tunnel anywhere is not served: unknown (404), not connected (503), or this
/// replica drains and its tunnels are gone (503, retry).
async fn no_tunnel(shared: &Shared, name: &str) -> ApiError {
    match shared.store.cluster(name).await {
        Ok(None) => ApiError::cluster_not_found(name),
        Ok(Some(_)) if shared.is_shutting_down() => ApiError::shutting_down(),
        Ok(Some(_)) => ApiError::not_connected(name),
        Err(e) => e.into(),
    }
}

/// Forwards `req` over `stream`, a stream just opened on a tunnel here: with binary heads when the tunnel's
/// agent serves them (`heads`, and the stream was opened with that kind), else as HTTP/1.1.
async fn forward_stream<B, G>(
    stream: tether_tunnel::Stream,
    heads: bool,
    req: Request<B>,
    target: Target<'_>,
    guard: G,
) -> Result<Response<Body>, ApiError>
where
    B: http_body::Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<BoxError>,
    G: Send + 'static,
{
    let (accepted, abort) = answer_and_abort(&stream);
    if heads {
        return forward::forward_heads(stream, accepted, abort, req, target, guard).await;
    }
    forward::forward(stream, accepted, req, target, guard).await
}

/// What forwarding needs from a stream just opened: the peer's answer to its OPEN, and a way to cut it
/// (a reset with `CANCEL`).
fn answer_and_abort(
    stream: &tether_tunnel::Stream,
) -> (
    impl Future<Output = Result<Bytes, TunnelError>> + use<>,
    impl Fn() + Clone + Send + 'static,
) {
    let control = stream.control();
    let reset = control.clone();
    (async move { control.accepted().await }, move || {
        reset.reset(code::CANCEL)
    })
}

/// Forwards the bodyless request `parts` over `stream`, a binary-heads stream just opened on a tunnel here.
async fn forward_bodyless<G: Send + 'static>(
    stream: tether_tunnel::Stream,
    parts: &http::request::Parts,
    target: Target<'_>,
    guard: G,
) -> Result<Response<Body>, ApiError> {
    let (accepted, abort) = answer_and_abort(&stream);
    forward::forward_heads_bodyless(stream, accepted, abort, parts, target, guard).await
}

/// Serves `req` over one of `tunnels` (usable tunnels of this replica, least loaded first): the peer link's
/// requests, which were checked and counted by the replica that received them.
pub(crate) async fn forward_local<G: Send + 'static>(
    shared: &Shared,
    tunnels: &[Tunnel],
    req: Request<Incoming>,
    target: Target<'_>,
    guard: G,
) -> Result<Response<Body>, ApiError> {
    let (stream, tunnel) = open_stream(shared, tunnels, target)?;
    let target = Target {
        watches_end: Some(&tunnel.info.gone),
        ..target
    };
    tracing::debug!(cluster = target.cluster, method = %req.method(), path = req.uri().path(), stream = ?stream.id(), "forwarding for a peer");
    forward_stream(stream, tunnel.info.http_heads(), req, target, guard).await
}

/// A GET or HEAD without a body that asks for no upgrade: sending it again changes nothing in the cluster.
pub(crate) fn is_safe_and_bodyless<B: http_body::Body>(req: &Request<B>) -> bool {
    matches!(*req.method(), http::Method::GET | http::Method::HEAD)
        && req.body().is_end_stream()
        && !forward::is_upgrade_request(req)
}

/// Serves a safe, bodyless request (see [`is_safe_and_bodyless`]) over `tunnels`, least loaded first: when the
/// tunnel it went on goes away before the cluster answers (the agent retiring a surplus tunnel or moving it to
/// another replica refuses or resets its streams with SHUTDOWN; the tunnel closes), the next tunnel takes it.
pub(crate) async fn forward_safe<G: Send + Clone + 'static>(
    shared: &Shared,
    tunnels: &[Tunnel],
    parts: &http::request::Parts,
    target: Target<'_>,
    guard: G,
) -> Result<Response<Body>, ApiError> {
    let mut last = None;
    for (i, tunnel) in tunnels.iter().enumerate() {
        let stream = match open_stream(shared, std::slice::from_ref(tunnel), target) {
            Ok((stream, _)) => stream,
            Err(e) => {
                last = Some(e);
                continue;
            }
        };
        tracing::debug!(cluster = target.cluster, method = %parts.method, path = parts.uri.path(), stream = ?stream.id(), attempt = i + 1, "forwarding");
        // A watch ends cleanly once its tunnel goes away (or this replica stops serving).
        let target = Target {
            watches_end: Some(&tunnel.info.gone),
            ..target
        };
        // With binary heads the head is encoded from `parts` as they are; only an agent without them gets a copy.
        let result = if tunnel.info.http_heads() {
            forward_bodyless(stream, parts, target, guard.clone()).await
        } else {
            forward_stream(stream, false, again(parts), target, guard.clone()).await
        };
        match result {
            Err(e) if e.tunnel_gone => {
                tracing::debug!(cluster = target.cluster, error = %e.message, "the tunnel went away under a safe request; trying the next");
                last = Some(e);
            }
            result => return result,
        }
    }
    Err(last.unwrap_or_else(|| ApiError::not_connected(target.cluster)))
}

/// A bodyless request made again from `parts` (without the incoming connection's extensions).
pub(crate) fn again(parts: &http::request::Parts) -> Request<http_body_util::Empty<Bytes>> {
    let mut again = Request::new(http_body_util::Empty::<Bytes>::new());
    *again.method_mut() = parts.method.clone();
    *again.uri_mut() = parts.uri.clone();
    *again.version_mut() = parts.version;
    *again.headers_mut() = parts.headers.clone();
    again
}

/// Opens a stream on the first of `tunnels` (least loaded first) that takes one: a tunnel that went away
/// since it was picked is skipped.
fn open_stream<'t>(
    shared: &Shared,
    tunnels: &'t [Tunnel],
    target: Target<'_>,
) -> Result<(tether_tunnel::Stream, &'t Tunnel), ApiError> {
    let mut last = None;
    for tunnel in tunnels {
        let opened = tunnel.conn.open(OpenOptions {
            kind: if tunnel.info.http_heads() {
                kind::HTTP_HEADS
            } else {
                kind::HTTP
            },
            priority: Priority::Normal,
            deadline: Some(shared.config.open_timeout),
            metadata: Bytes::new(),
        });
        match opened {
            Ok(stream) => return Ok((stream, tunnel)),
            // Going away, closed, or full: the next tunnel may take it.
            Err(e @ (TunnelError::Closed(_) | TunnelError::TooManyStreams)) => last = Some(e),
            Err(e) => return Err(forward::tunnel_error(e, target)),
        }
    }
    match last {
        Some(e) => Err(forward::tunnel_error(e, target)),
        None => Err(ApiError::not_connected(target.cluster)),
    }
}

/// Counts the connection for `principal` if it counts for nobody yet.
fn count_connection(shared: &Shared, ctx: &ConnCtx, principal: &Principal) -> Result<(), Refusal> {
    let mut held = ctx
        .principal
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if held.is_none() {
        *held = Some(shared.quotas.admit_connection(principal)?);
    }
    Ok(())
}

/// A response body that keeps its stream's [`StreamSlot`] counted until the body ends or is dropped, and tells
/// it when the body ended on its own (so that only the user dropping it early is a cancellation).
struct Holding {
    body: Body,
    slot: Arc<StreamSlot>,
}

impl http_body::Body for Holding {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let frame = Pin::new(&mut self.body).poll_frame(cx);
        if matches!(frame, Poll::Ready(None | Some(Err(_)))) {
            self.slot.finish();
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        let end = self.body.is_end_stream();
        if end {
            self.slot.finish();
        }
        end
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

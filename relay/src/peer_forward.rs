//! A user request for a cluster without a usable tunnel at this replica goes to a replica that has one, over
//! the peer link ([`crate::peer_client`]), after this replica did everything it does for a local request (the
//! credential pre-check, the Entra check, the per-principal and per-address bounds: `handlers::user`).
//!
//! Routes come from the store (the tunnels of live replicas, reused for [`crate::fleet::ROUTE_CACHE`]):
//! usable tunnels of replicas with a peer link, not draining ones first, the rest in random order, one attempt
//! per replica. An attempt whose connection fails, or that the peer answers with `tether-route: none` (it no
//! longer holds a usable tunnel), goes on to the next replica as long as the request body was not sent (a
//! request without a body can always go on); the routes are then read again at the next request. The peer
//! answers with a response or a 101: the response streams back (a JSON watch whose peer is lost ends with an
//! ERROR event), the 101 becomes a byte pipe between the user and the peer, as for a tunnel.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use rand::seq::SliceRandom as _;

use crate::api_error::ApiError;
use crate::body::{Body, BoxError};
use crate::ends;
use crate::forward::{self, Target};
use crate::peer_client::{PeerBody, PeerClient};
use crate::state::Shared;
use crate::store::TunnelRoute;

/// The header a peer sets on its 503 when it holds no usable tunnel for the cluster (the caller tries the
/// next route).
pub(crate) const NO_ROUTE_HEADER: &str = "tether-route";

/// A replica to try: its id and peer link address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Candidate {
    pub(crate) replica: String,
    pub(crate) address: String,
}

/// The replicas to try for `cluster`, in order; empty when no other replica holds a usable tunnel of it. The
/// routes are read again when the cached ones give none (a tunnel may have just moved).
pub(crate) async fn candidates(shared: &Shared, cluster: &str) -> Result<Vec<Candidate>, ApiError> {
    if let Some(routes) = shared.fleet.cached_routes(cluster) {
        let cached = order(&routes, &shared.fleet.replica_id);
        if !cached.is_empty() {
            return Ok(cached);
        }
    }
    fresh_candidates(shared, cluster).await
}

/// [`candidates`] read from the store now.
async fn fresh_candidates(shared: &Shared, cluster: &str) -> Result<Vec<Candidate>, ApiError> {
    let routes = shared.store.tunnel_routes(Some(cluster)).await?;
    let ordered = order(&routes, &shared.fleet.replica_id);
    shared.fleet.cache_routes(cluster, routes);
    Ok(ordered)
}

/// One candidate per replica holding a usable tunnel (never `me`): replicas not draining first, each group
/// shuffled.
fn order(routes: &[TunnelRoute], me: &str) -> Vec<Candidate> {
    let mut ready = Vec::new();
    let mut draining = Vec::new();
    for route in routes {
        let Some(address) = &route.peer_address else {
            continue;
        };
        if !route.tunnel.usable || route.tunnel.replica == me {
            continue;
        }
        let group = if route.replica_draining {
            &mut draining
        } else {
            &mut ready
        };
        if !group
            .iter()
            .any(|c: &Candidate| c.replica == route.tunnel.replica)
        {
            group.push(Candidate {
                replica: route.tunnel.replica.clone(),
                address: address.clone(),
            });
        }
    }
    let mut rng = rand::rng();
    ready.shuffle(&mut rng);
    draining.shuffle(&mut rng);
    ready.extend(draining);
    ready
}

/// Why a watch forwarded to a peer broke off, in the user's terms.
fn explain_peer_break(cluster: &str, e: &BoxError) -> String {
    format!("the relay replica holding the tunnel of cluster {cluster} was lost: {e}")
}

/// Sends `req` for `target.cluster` to the first of `candidates` that takes it. `guard` is kept as long as
/// an upgraded pipe runs.
pub(crate) async fn forward<G, B>(
    shared: &Shared,
    candidates: Vec<Candidate>,
    mut req: Request<B>,
    target: Target<'_>,
    guard: G,
) -> Result<Response<Body>, ApiError>
where
    G: Send + 'static,
    B: http_body::Body<Data = bytes::Bytes> + Send + Sync + 'static,
    B::Error: Into<BoxError>,
{
    let cluster = target.cluster;
    let peers = &shared.fleet.peers;
    let upgrade = forward::is_upgrade_request(&req);
    let user_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
    let (mut parts, body) = req.into_parts();
    // The peer's own connection: no Host of the user's, no extensions of the incoming connection.
    parts.headers.remove(header::HOST);
    parts.extensions = http::Extensions::new();
    if upgrade {
        parts.version = http::Version::HTTP_11;
        parts
            .headers
            .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    } else {
        parts.version = http::Version::HTTP_2;
        forward::strip_hop_by_hop(&mut parts.headers, false);
    }
    let path_and_query = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    let bodyless = http_body::Body::is_end_stream(&body);
    let slot: Arc<Mutex<Option<Body>>> =
        Arc::new(Mutex::new(Some(body.map_err(Into::into).boxed())));
    let mut last: Option<ApiError> = None;
    let mut tried: Vec<String> = Vec::new();
    let mut queue: VecDeque<Candidate> = candidates.into();
    let mut refreshed = false;
    loop {
        let Some(candidate) = queue.pop_front() else {
            // Every route failed: the tunnel may have moved since the routes were read; read them once more.
            if refreshed {
                break;
            }
            refreshed = true;
            queue = fresh_candidates(shared, cluster)
                .await?
                .into_iter()
                .filter(|c| !tried.contains(&c.replica))
                .collect();
            if queue.is_empty() {
                break;
            }
            continue;
        };
        tried.push(candidate.replica.clone());
        let sent_before = slot.lock().map(|s| s.is_none()).unwrap_or(true);
        if !bodyless && sent_before {
            // An earlier attempt sent (part of) the body: it cannot be sent again.
            break;
        }
        if bodyless {
            let mut s = slot
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if s.is_none() {
                *s = Some(crate::body::empty());
            }
        }
        peers.learn(&candidate.replica, &candidate.address);
        let uri = PeerClient::uri(&candidate.replica, &path_and_query)
            .map_err(|e| ApiError::bad_request(format!("invalid request path: {e}")))?;
        let mut attempt = Request::from_parts(parts.clone(), PeerBody::from_slot(&slot));
        *attempt.uri_mut() = uri;
        let wait = shared.config.request_timeout + shared.config.open_timeout;
        let answer = match tokio::time::timeout(wait, peers.send(attempt, upgrade)).await {
            Ok(answer) => answer,
            Err(_) => {
                shared.fleet.forget_routes(cluster);
                return Err(ApiError::tunnel(
                    StatusCode::GATEWAY_TIMEOUT,
                    "Timeout",
                    format!(
                        "the relay replica {} holding the tunnel of cluster {cluster} did not answer within {wait:?}",
                        candidate.replica
                    ),
                )
                .mark_retryable());
            }
        };
        match answer {
            Ok(resp) if resp.headers().contains_key(NO_ROUTE_HEADER) => {
                tracing::debug!(cluster, replica = %candidate.replica, "the peer holds no usable tunnel any more; trying the next");
                shared.fleet.forget_routes(cluster);
                last = Some(ApiError::not_connected(cluster));
            }
            Ok(resp) => {
                return answer_user(shared, resp, user_upgrade, cluster, &target, guard);
            }
            Err(e) if e.is_connect() => {
                tracing::info!(cluster, replica = %candidate.replica, address = %candidate.address, error = %e, "cannot reach the peer; trying the next route");
                shared.fleet.forget_routes(cluster);
                last = Some(
                    ApiError::tunnel(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "ServiceUnavailable",
                        format!(
                            "cluster {cluster} is connected to another relay replica ({}) that could not be reached",
                            candidate.replica
                        ),
                    )
                    .mark_retryable(),
                );
            }
            Err(e) => {
                shared.fleet.forget_routes(cluster);
                return Err(ApiError::tunnel(
                    StatusCode::BAD_GATEWAY,
                    "BadGateway",
                    format!(
                        "the relay replica {} holding the tunnel of cluster {cluster} failed: {e}",
                        candidate.replica
                    ),
                )
                .mark_retryable());
            }
        }
    }
    Err(last.unwrap_or_else(|| ApiError::not_connected(cluster)))
}

/// The peer's answer, for the user: a 101 becomes a byte pipe (kept with `guard`), a JSON watch ends with an
/// ERROR event if the peer is lost, anything else streams through.
fn answer_user<G>(
    shared: &Shared,
    mut resp: Response<Incoming>,
    user_upgrade: Option<hyper::upgrade::OnUpgrade>,
    cluster: &str,
    target: &Target<'_>,
    guard: G,
) -> Result<Response<Body>, ApiError>
where
    G: Send + 'static,
{
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        let Some(user_upgrade) = user_upgrade else {
            return Err(ApiError::tunnel(
                StatusCode::BAD_GATEWAY,
                "BadGateway",
                "the peer answered 101 Switching Protocols to a request that did not ask to upgrade",
            ));
        };
        let peer_upgrade = hyper::upgrade::on(&mut resp);
        let headers = resp.headers().clone();
        let cluster = cluster.to_owned();
        let cut = shared.cut.clone();
        tokio::spawn(async move {
            let _guard = guard;
            match tokio::join!(user_upgrade, peer_upgrade) {
                (Ok(user), Ok(peer)) => {
                    let pipe =
                        forward::pipe(TokioIo::new(user), TokioIo::new(peer), &headers, &cluster);
                    tokio::select! {
                        () = pipe => {}
                        () = cut.cancelled() => {
                            tracing::info!(cluster = %cluster, "upgraded stream through a peer cut: drain timeout reached");
                        }
                    }
                }
                (user, peer) => tracing::debug!(
                    cluster = %cluster,
                    user = ?user.err(),
                    peer = ?peer.err(),
                    "upgrade through the peer did not complete on both sides"
                ),
            }
        });
        let (mut parts, _) = resp.into_parts();
        parts
            .headers
            .insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
        return Ok(Response::from_parts(parts, crate::body::empty()));
    }
    forward::strip_hop_by_hop(resp.headers_mut(), false);
    let cut = shared.cut.clone();
    let resp = resp.map(|body| Cuttable::new(body, cut));
    if resp.status().is_success()
        && ends::is_watch_request(target.path_and_query)
        && ends::is_json(resp.headers())
    {
        return Ok(resp.map(|b| {
            ends::WatchBody::new(b, cluster, explain_peer_break)
                .ending_with(target.watches_end)
                .boxed()
        }));
    }
    Ok(resp.map(BodyExt::boxed))
}

/// A response body from a peer that fails when this replica's drain timeout is reached, so a watch ends
/// with an ERROR event rather than being dropped.
struct Cuttable {
    inner: Incoming,
    cut: Pin<Box<WaitForCancellationFutureOwned>>,
}

impl Cuttable {
    fn new(inner: Incoming, cut: CancellationToken) -> Self {
        Self {
            inner,
            cut: Box::pin(cut.cancelled_owned()),
        }
    }
}

impl http_body::Body for Cuttable {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.cut.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Some(Err(
                "this relay replica is shutting down (drain timeout reached)".into(),
            )));
        }
        Pin::new(&mut self.inner)
            .poll_frame(cx)
            .map_err(|e| Box::new(e) as BoxError)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::TunnelRecord;

    fn route(replica: &str, id: u64, usable: bool, draining: bool, peer: bool) -> TunnelRoute {
        TunnelRoute {
            tunnel: TunnelRecord {
                replica: replica.into(),
                tunnel_id: id,
                cluster: "c".into(),
                agent_instance: String::new(),
                agent_tunnels: 0,
                transport: "wss".into(),
                agent_address: "10.0.0.1:1".into(),
                connected_since: time::OffsetDateTime::UNIX_EPOCH,
                usable,
            },
            peer_address: peer.then(|| format!("{replica}:9443")),
            replica_draining: draining,
        }
    }

    #[test]
    fn one_candidate_per_replica_usable_ones_not_draining_first_never_this_one() {
        let routes = [
            route("me", 1, true, false, true),
            route("a", 1, true, false, true),
            route("a", 2, true, false, true),
            route("b", 1, false, false, true),
            route("c", 1, true, true, true),
            route("d", 1, true, false, false),
            route("e", 1, true, false, true),
        ];
        for _ in 0..20 {
            let order = order(&routes, "me");
            let names: Vec<&str> = order.iter().map(|c| c.replica.as_str()).collect();
            assert_eq!(names.len(), 3, "{names:?}");
            assert_eq!(names[2], "c", "the draining replica comes last: {names:?}");
            let mut first_two = names[..2].to_vec();
            first_two.sort_unstable();
            assert_eq!(first_two, ["a", "e"]);
            assert_eq!(
                order
                    .iter()
                    .find(|c| c.replica == "a")
                    .map(|c| c.address.as_str()),
                Some("a:9443")
            );
        }
    }
}

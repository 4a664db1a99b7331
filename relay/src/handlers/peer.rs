//! The peer link's one endpoint: `/clusters/NAME/…` forwarded by another replica of the fleet, which already
//! checked the request's credential and counted it against its client's bounds. This replica serves it only
//! over a tunnel it holds — it never forwards again — and still refuses a request without a plausible
//! credential. Without a usable tunnel here it answers 503 with `tether-route: none`, and the forwarding
//! replica tries its next route. The client address is the one the first replica set in `X-Forwarded-For`.

use http::{HeaderValue, Request, Response};
use hyper::body::Incoming;

use super::user;
use crate::api_error::ApiError;
use crate::auth;
use crate::body::Body;
use crate::forward::Target;
use crate::peer_forward::NO_ROUTE_HEADER;
use crate::state::{ConnCtx, Shared};
use crate::user_headers;

/// Handles `/clusters/{rest}` from a peer.
pub(crate) async fn handle(
    shared: &Shared,
    ctx: ConnCtx,
    req: Request<Incoming>,
    rest: &str,
) -> Result<Response<Body>, ApiError> {
    let (name, path) = match rest.split_once('/') {
        Some((name, path)) => (name, format!("/{path}")),
        None => (rest, "/".to_owned()),
    };
    user_headers::plausible_bearer(req.headers())
        .map_err(|e| ApiError::unauthorized(e.to_string()))?;
    if !auth::valid_cluster_name(name) {
        return Err(ApiError::cluster_not_found(name));
    }
    let tunnels = shared.registry.usable(name);
    if tunnels.is_empty() {
        let mut resp = ApiError::not_connected(name).into_response();
        resp.headers_mut()
            .insert(NO_ROUTE_HEADER, HeaderValue::from_static("none"));
        return Ok(resp);
    }
    let path_and_query = match req.uri().query() {
        Some(q) => format!("{path}?{q}"),
        None => path,
    };
    let target = Target {
        cluster: name,
        path_and_query: &path_and_query,
        open_timeout: shared.config.open_timeout,
        request_timeout: shared.config.request_timeout,
        watches_end: Some(&shared.watches_end),
    };
    if user::is_safe_and_bodyless(&req) {
        // The tunnels here going away under it (the agent moving them): the replica that sent it tries the
        // next route, as for a replica without the tunnel.
        let (parts, _) = req.into_parts();
        return match user::forward_safe(shared, &tunnels, &parts, target, ctx.permit).await {
            Err(e) if e.tunnel_gone => {
                let mut resp = e.into_response();
                resp.headers_mut()
                    .insert(NO_ROUTE_HEADER, HeaderValue::from_static("gone"));
                Ok(resp)
            }
            resp => resp,
        };
    }
    user::forward_local(shared, &tunnels, req, target, ctx.permit).await
}

//! Routing: which handler answers which path; every handler error becomes a Kubernetes `Status` here.

use std::sync::Arc;

use http::{Method, Request, Response};
use hyper::body::Incoming;

use crate::api_error::ApiError;
use crate::body::Body;
use crate::handlers::{agent, clusters, health, peer, rbac, user};
use crate::state::{ConnCtx, Shared};

/// Where a connection is served when the relay runs shards, by its first request's target: a user's with the
/// tunnel of the cluster it names (its requests then never change threads between the two), anything else
/// wherever (`None`).
pub(crate) fn place(shared: &Shared, target: &str) -> Option<usize> {
    let rest = target.strip_prefix("/clusters/")?;
    let name = rest.split(['/', '?']).next()?;
    shared.registry.shard_of(name)
}

/// Dispatches a request; every error becomes a `Status` response here.
pub(crate) async fn route(
    shared: Arc<Shared>,
    ctx: ConnCtx,
    req: Request<Incoming>,
) -> Response<Body> {
    let path = req.uri().path().to_owned();
    let result = if path == "/healthz" {
        health::healthz(req.method())
    } else if path == "/readyz" {
        health::readyz(&shared, req.method()).await
    } else if let Some(rest) = path.strip_prefix("/clusters/") {
        user::handle(&shared, ctx, req, rest).await
    } else if path == "/agent/v1/onboard" {
        if req.method() == Method::POST {
            agent::onboard(&shared, req).await
        } else {
            Err(ApiError::method_not_allowed())
        }
    } else if path == "/agent/v1/tunnel" {
        if req.method() == Method::GET {
            agent::tunnel(&shared, ctx, req).await
        } else {
            Err(ApiError::method_not_allowed())
        }
    } else if path == "/agent/v1/check" {
        if req.method() == Method::GET {
            agent::check(&shared, &ctx, &req).await
        } else {
            Err(ApiError::method_not_allowed())
        }
    } else if path == "/api/v1/clusters" {
        clusters::handle(&shared, req, None).await
    } else if let Some(name) = path.strip_prefix("/api/v1/clusters/") {
        let name = name.to_owned();
        clusters::handle(&shared, req, Some(&name)).await
    } else if let Some(rest) = collection(&path, "/api/v1/roledefinitions") {
        rbac::role_definitions(&shared, req, rest.as_deref()).await
    } else if let Some(rest) = collection(&path, "/api/v1/roleassignments") {
        rbac::role_assignments(&shared, req, rest.as_deref()).await
    } else if let Some(rest) = collection(&path, "/api/v1/denyassignments") {
        rbac::deny_assignments(&shared, req, rest.as_deref()).await
    } else if let Some(oid) = path.strip_prefix("/api/v1/directory/users/") {
        let oid = oid.to_owned();
        rbac::directory(&shared, req, &oid).await
    } else {
        Err(ApiError::not_found(format!("the relay serves no {path}")))
    };
    result.unwrap_or_else(ApiError::into_response)
}

/// Dispatches a request that came over the peer link: only `/clusters/…` is served there.
pub(crate) async fn route_peer(
    shared: Arc<Shared>,
    ctx: ConnCtx,
    req: Request<Incoming>,
) -> Response<Body> {
    let path = req.uri().path().to_owned();
    let result = match path.strip_prefix("/clusters/") {
        Some(rest) => peer::handle(&shared, ctx, req, rest).await,
        None => Err(ApiError::not_found(format!(
            "the peer link serves only /clusters/…, not {path}"
        ))),
    };
    result.unwrap_or_else(ApiError::into_response)
}

/// `Some(None)` for `path == base`, `Some(Some(rest))` for `base/rest`, `None` otherwise.
fn collection(path: &str, base: &str) -> Option<Option<String>> {
    let rest = path.strip_prefix(base)?;
    if rest.is_empty() {
        Some(None)
    } else {
        rest.strip_prefix('/').map(|r| Some(r.to_owned()))
    }
}

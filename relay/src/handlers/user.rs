//! The user endpoint: `/clusters/NAME/…` forwarded over NAME's tunnel.

use bytes::Bytes;
use http::{Request, Response};
use hyper::body::Incoming;
use tether_tunnel::{OpenOptions, Priority, kind};

use crate::api_error::ApiError;
use crate::body::Body;
use crate::forward::{self, Target};
use crate::state::{ConnCtx, Shared};
use crate::{auth, entra};

/// Handles `/clusters/{rest}` where `rest` is `NAME` or `NAME/…`. Refuses at once — before anything enters a
/// tunnel — without credentials or with an Entra-style token that does not validate (401), for an unknown
/// cluster (404) or one without a tunnel (503).
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
    if !auth::has_authorization(req.headers()) {
        return Err(ApiError::unauthorized(
            "no credentials: requests through the relay must carry the cluster's own Authorization header",
        ));
    }
    if let Some(authenticator) = &shared.entra {
        entra::check(authenticator, req.headers())
            .await
            .map_err(|e| ApiError::unauthorized(e.to_string()))?;
    }
    if !auth::valid_cluster_name(name) {
        return Err(ApiError::cluster_not_found(name));
    }
    // The registry answers for connected clusters without touching the store on the hot path; deleting a
    // cluster removes its tunnel, so a registered tunnel implies the cluster exists.
    let Some(tunnel) = shared.registry.get(name) else {
        return match shared.store.cluster(name).await? {
            Some(_) => Err(ApiError::not_connected(name)),
            None => Err(ApiError::cluster_not_found(name)),
        };
    };
    if shared.is_shutting_down() {
        return Err(ApiError::shutting_down());
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
    };
    let stream = tunnel
        .conn
        .open(OpenOptions {
            kind: kind::HTTP,
            priority: Priority::Normal,
            deadline: Some(shared.config.open_timeout),
            metadata: Bytes::new(),
        })
        .map_err(|e| forward::tunnel_error(e, target))?;
    let control = stream.control();
    tracing::debug!(cluster = name, method = %req.method(), path = req.uri().path(), stream = ?stream.id(), "forwarding");
    forward::forward(
        stream,
        async move { control.accepted().await },
        req,
        target,
        ctx.permit,
    )
    .await
}

//! The admin REST API: `/api/v1/clusters[/NAME]`, bearer admin token.

use std::collections::BTreeMap;

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde::Deserialize;
use serde_json::{Value, json};
use tether_tunnel::code;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::auth;
use crate::body::Body;
use crate::error::ApiError;
use crate::server::{self, Shared};
use crate::store::{ClusterRecord, NewCluster, TokenHash};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateCluster {
    name: String,
    #[serde(default)]
    tags: BTreeMap<String, String>,
}

/// Handles `/api/v1/clusters` (`name` = `None`) and `/api/v1/clusters/NAME`.
pub(crate) async fn handle(
    shared: &Shared,
    req: Request<Incoming>,
    name: Option<&str>,
) -> Result<Response<Body>, ApiError> {
    let authorized = auth::bearer(req.headers())
        .is_some_and(|t| TokenHash::of(t.expose()).ct_eq(&shared.admin_token_hash));
    if !authorized {
        return Err(ApiError::unauthorized(
            "a valid admin token is required (Authorization: Bearer ADMIN_TOKEN)",
        ));
    }
    match (req.method().clone(), name) {
        (Method::POST, None) => create(shared, req).await,
        (Method::GET, None) => list(shared).await,
        (Method::GET, Some(name)) => show(shared, name).await,
        (Method::DELETE, Some(name)) => delete(shared, name).await,
        _ => Err(ApiError::method_not_allowed()),
    }
}

async fn create(shared: &Shared, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let body: CreateCluster = server::read_json(shared, req.into_body()).await?;
    if !auth::valid_cluster_name(&body.name) {
        return Err(ApiError::invalid(format!(
            "invalid cluster name {:?}: must be a DNS-1123 label (at most 63 characters: a-z, 0-9 and '-', \
             starting and ending with a letter or digit)",
            body.name
        )));
    }
    if let Some(key) = body.tags.keys().find(|k| k.is_empty() || k.len() > 253) {
        return Err(ApiError::invalid(format!(
            "invalid tag key {key:?}: must be 1 to 253 characters"
        )));
    }
    let token = auth::generate_token();
    let new = NewCluster {
        name: body.name,
        tags: body.tags,
        onboarding_token_hash: TokenHash::of(token.expose()),
        created_at: OffsetDateTime::now_utc(),
    };
    let record = shared.store.create_cluster(&new).await?;
    tracing::info!(cluster = %record.name, "cluster registered");
    let mut value = cluster_json(shared, &record);
    if let Some(obj) = value.as_object_mut() {
        // The only time the onboarding token is ever shown.
        obj.insert(
            "onboardingToken".into(),
            Value::String(token.expose().to_owned()),
        );
    }
    Ok(server::json(StatusCode::CREATED, &value))
}

async fn list(shared: &Shared) -> Result<Response<Body>, ApiError> {
    let items: Vec<Value> = shared
        .store
        .list_clusters()
        .await?
        .iter()
        .map(|c| cluster_json(shared, c))
        .collect();
    Ok(server::json(StatusCode::OK, &json!({ "items": items })))
}

async fn show(shared: &Shared, name: &str) -> Result<Response<Body>, ApiError> {
    match shared.store.cluster(name).await? {
        Some(record) => Ok(server::json(StatusCode::OK, &cluster_json(shared, &record))),
        None => Err(ApiError::cluster_not_found(name)),
    }
}

async fn delete(shared: &Shared, name: &str) -> Result<Response<Body>, ApiError> {
    // Deleting the row revokes the credential; then the live tunnel goes.
    if !shared.store.delete_cluster(name).await? {
        return Err(ApiError::cluster_not_found(name));
    }
    if let Some(tunnel) = shared.registry.remove(name) {
        // Not SHUTDOWN: the agent would take that as a graceful GOAWAY and keep its streams open.
        tunnel
            .conn
            .close(code::REFUSED, "cluster deleted at the relay");
    }
    tracing::info!(cluster = %name, "cluster deleted");
    let mut resp = Response::new(crate::body::empty());
    *resp.status_mut() = StatusCode::NO_CONTENT;
    Ok(resp)
}

fn rfc3339(t: Option<OffsetDateTime>) -> Value {
    t.and_then(|t| t.format(&Rfc3339).ok())
        .map_or(Value::Null, Value::String)
}

/// The cluster as the API shows it; `connected` and `connectedSince` come from the live registry.
fn cluster_json(shared: &Shared, c: &ClusterRecord) -> Value {
    let live = shared.registry.get(&c.name);
    json!({
        "name": c.name,
        "tags": c.tags,
        "createdAt": rfc3339(Some(c.created_at)),
        "onboarded": c.onboarded,
        "connected": live.is_some(),
        "connectedSince": rfc3339(live.map(|t| t.since)),
        "lastSeen": rfc3339(c.last_seen),
        "agentVersion": c.agent_version,
    })
}

//! The agent endpoints: onboarding (token → credential) and the tunnel (WebSocket upgrade).

use std::sync::Arc;

use http::{HeaderMap, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use serde_json::json;
use tether_tunnel::{Connection, Role, code, ws};
use time::OffsetDateTime;

use crate::auth;
use crate::body::Body;
use crate::error::ApiError;
use crate::server::{self, ConnCtx, Shared};
use crate::store::TokenHash;

const BAD_ONBOARDING_TOKEN: &str = "onboarding token is invalid or already used";
const BAD_CREDENTIAL: &str =
    "agent credential is invalid for this cluster (onboard the agent again)";

#[derive(Deserialize)]
struct Onboard {
    cluster: String,
    token: String,
}

/// `POST /agent/v1/onboard`: trades a one-time onboarding token for the cluster's credential.
pub(crate) async fn onboard(
    shared: &Shared,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let body: Onboard = server::read_json(shared, req.into_body()).await?;
    let token_hash = TokenHash::of(&body.token);
    // Unknown cluster, wrong token and used token all get the same answer: nothing leaks.
    let secrets = match auth::valid_cluster_name(&body.cluster) {
        true => shared.store.secrets(&body.cluster).await?,
        false => None,
    };
    let matches = secrets.is_some_and(|s| {
        !s.onboarding_used
            && s.onboarding_token_hash
                .is_some_and(|stored| stored.ct_eq(&token_hash))
    });
    if !matches {
        return Err(ApiError::unauthorized(BAD_ONBOARDING_TOKEN));
    }
    let credential = auth::generate_token();
    let redeemed = shared
        .store
        .redeem_onboarding_token(
            &body.cluster,
            &token_hash,
            &TokenHash::of(credential.expose()),
            OffsetDateTime::now_utc(),
        )
        .await?;
    if !redeemed {
        // Lost a race with a concurrent redemption of the same token.
        return Err(ApiError::unauthorized(BAD_ONBOARDING_TOKEN));
    }
    tracing::info!(cluster = %body.cluster, "agent onboarded");
    Ok(server::json(
        StatusCode::OK,
        &json!({ "cluster": body.cluster, "credential": credential.expose() }),
    ))
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|s| !s.is_empty())
}

/// A printable, bounded version string (it ends up in the store and the API).
fn agent_version(headers: &HeaderMap) -> String {
    match header_str(headers, "tether-agent-version") {
        Some(v) if v.len() <= 64 && v.bytes().all(|b| b.is_ascii_graphic()) => v.to_owned(),
        Some(_) => "invalid".to_owned(),
        None => "unknown".to_owned(),
    }
}

/// `GET /agent/v1/tunnel`: authenticates the agent, then upgrades to WebSocket and starts the tunnel.
pub(crate) async fn tunnel(
    shared: &Arc<Shared>,
    ctx: ConnCtx,
    mut req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let cluster = header_str(req.headers(), "tether-cluster")
        .unwrap_or_default()
        .to_owned();
    let presented = auth::bearer(req.headers());
    let secrets = match (auth::valid_cluster_name(&cluster), &presented) {
        (true, Some(_)) => shared.store.secrets(&cluster).await?,
        _ => None,
    };
    let authentic = match (secrets.and_then(|s| s.credential_hash), presented) {
        (Some(stored), Some(presented)) => stored.ct_eq(&TokenHash::of(presented.expose())),
        _ => false,
    };
    if !authentic {
        tracing::info!(cluster = %cluster, peer = %ctx.peer, "agent tunnel refused: bad credential");
        return Err(ApiError::unauthorized(BAD_CREDENTIAL));
    }
    if shared.is_shutting_down() {
        return Err(ApiError::shutting_down());
    }
    let version = agent_version(req.headers());
    let switch = ws::upgrade_response(&req).map_err(ApiError::bad_request)?;
    let on_upgrade = hyper::upgrade::on(&mut req);
    let task_shared = shared.clone();
    shared.tasks.spawn(async move {
        let upgraded = match on_upgrade.await {
            Ok(u) => u,
            Err(e) => {
                tracing::info!(cluster = %cluster, error = %e, "agent tunnel upgrade failed");
                return;
            }
        };
        let mut session = task_shared.config.tunnel.clone();
        session.role = Role::Server;
        let conn = ws::accept_upgraded(TokioIo::new(upgraded), session);
        run_tunnel(&task_shared, &cluster, &version, conn).await;
        drop(ctx);
    });
    let (parts, ()) = switch.into_parts();
    Ok(Response::from_parts(parts, crate::body::empty()))
}

/// Owns one agent tunnel from registration to removal.
async fn run_tunnel(shared: &Shared, cluster: &str, version: &str, conn: Connection) {
    let (id, replaced) = shared.registry.insert(cluster, conn.clone());
    if let Some(old) = replaced {
        old.conn.go_away(
            code::SHUTDOWN,
            "replaced by a newer tunnel for the same cluster",
        );
    }
    // A delete that ran between authentication and registration must still win.
    if !matches!(shared.store.cluster(cluster).await, Ok(Some(_))) {
        shared.registry.remove_if(cluster, id);
        conn.close(code::REFUSED, "cluster deleted at the relay");
        return;
    }
    tracing::info!(cluster, agent_version = version, "agent tunnel connected");
    if let Err(e) = shared
        .store
        .record_connected(cluster, version, OffsetDateTime::now_utc())
        .await
    {
        tracing::warn!(cluster, error = %e, "cannot record the connection");
    }

    // Agents may not open streams (yet): refuse each one.
    let refuser = {
        let conn = conn.clone();
        tokio::spawn(async move {
            while let Some(incoming) = conn.accept().await {
                incoming.refuse(
                    code::UNSUPPORTED_KIND,
                    "the relay accepts no streams from agents",
                );
            }
        })
    };

    let mut tick = tokio::time::interval(shared.config.limits.last_seen_interval);
    tick.reset(); // the first tick would fire at once; connected already set last-seen
    let closed = conn.closed();
    tokio::pin!(closed);
    let info = loop {
        tokio::select! {
            info = &mut closed => break info,
            _ = tick.tick() => {
                if let Err(e) = shared.store.record_seen(cluster, OffsetDateTime::now_utc()).await {
                    tracing::warn!(cluster, error = %e, "cannot record last-seen");
                }
            }
        }
    };
    refuser.abort();
    let current = shared.registry.remove_if(cluster, id);
    match &info.error {
        None => tracing::info!(cluster, "agent tunnel closed"),
        Some(e) => tracing::info!(cluster, error = %e, "agent tunnel lost"),
    }
    if current
        && let Err(e) = shared
            .store
            .record_disconnected(cluster, OffsetDateTime::now_utc())
            .await
    {
        tracing::warn!(cluster, error = %e, "cannot record the disconnection");
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    #[test]
    fn agent_versions_are_sanitised() {
        let mut h = HeaderMap::new();
        assert_eq!(agent_version(&h), "unknown");
        h.insert("tether-agent-version", HeaderValue::from_static("0.1.0"));
        assert_eq!(agent_version(&h), "0.1.0");
        h.insert(
            "tether-agent-version",
            HeaderValue::from_static("has space"),
        );
        assert_eq!(agent_version(&h), "invalid");
        let long = "x".repeat(65);
        h.insert(
            "tether-agent-version",
            HeaderValue::from_str(&long).unwrap_or(HeaderValue::from_static("")),
        );
        assert_eq!(agent_version(&h), "invalid");
    }
}

//! The agent endpoints: onboarding (token + CSR → the cluster's certificate) and the tunnel (mTLS, then a
//! WebSocket upgrade handed to [`crate::tunnels`], which owns the life of the tunnel). A QUIC tunnel
//! ([`quic_tunnel`], from [`crate::quic_listener`]) is authenticated by the same checks.

use std::sync::Arc;

use http::{HeaderMap, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use serde_json::json;
use tether_tunnel::{code, kind, quic, ws};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use super::body_limit;
use crate::api_error::ApiError;
use crate::auth;
use crate::body::Body;
use crate::identity::{self, PeerCert};
use crate::registry::Reservation;
use crate::respond;
use crate::state::{ConnCtx, Shared};
use crate::store::{NewIdentity, TokenHash};
use crate::tunnels::{self, NewTunnel};

const BAD_ONBOARDING_TOKEN: &str = "onboarding token is invalid or already used";
const ONBOARDING_TOKEN_EXPIRED: &str = "onboarding token expired (--onboarding-token-ttl): delete the cluster \
     and create it again for a new token";
const NO_CLIENT_CERT: &str = "no client certificate: the agent must present its cluster identity \
     (if its state was lost, delete the cluster and connect it again)";
const BAD_IDENTITY: &str = "the client certificate is not a valid identity of this cluster: it was deleted, \
     its identity revoked or replaced (delete the cluster and connect it again)";

const REPLACED_IDENTITY: &str = "the client certificate was replaced by a renewal and is no longer accepted: \
     the agent must use the certificate the renewal issued (if it lost it, delete the cluster and connect it again)";

#[derive(Deserialize)]
struct Onboard {
    cluster: String,
    token: String,
    csr: String,
}

/// `POST /agent/v1/onboard`: trades a one-time onboarding token and a CSR for the cluster's certificate.
pub(crate) async fn onboard(
    shared: &Shared,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let body: Onboard = respond::read_json(req.into_body(), body_limit(shared)).await?;
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
    let now = OffsetDateTime::now_utc();
    // The token was handed out when the cluster was created; only its holder learns that it expired.
    let created = shared
        .store
        .cluster(&body.cluster)
        .await?
        .map(|c| c.created_at);
    let ttl =
        time::Duration::try_from(shared.config.onboarding_token_ttl).unwrap_or(time::Duration::MAX);
    if created.is_none_or(|created| now - created > ttl) {
        return Err(ApiError::unauthorized(ONBOARDING_TOKEN_EXPIRED));
    }
    let issued = shared.agent_ca.issue(
        &body.cluster,
        &body.csr,
        shared.config.identity_validity,
        now,
    )?;
    let identity = NewIdentity {
        fingerprint: issued.fingerprint.clone(),
        not_after: issued.not_after,
    };
    let redeemed = shared
        .store
        .redeem_onboarding_token(&body.cluster, &token_hash, &identity, now)
        .await?;
    if !redeemed {
        // Lost a race with a concurrent redemption of the same token.
        return Err(ApiError::unauthorized(BAD_ONBOARDING_TOKEN));
    }
    let not_after = issued
        .not_after
        .format(&Rfc3339)
        .map_err(|e| ApiError::internal(format!("cannot format the expiry: {e}")))?;
    tracing::info!(cluster = %body.cluster, %not_after, fingerprint = %issued.fingerprint, "agent onboarded");
    Ok(respond::json(
        StatusCode::OK,
        &json!({ "cluster": body.cluster, "certificate": issued.pem, "notAfter": not_after }),
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
/// Whether the agent serves streams of kind `HTTP_HEADS`: its `Tether-Stream-Kinds` header lists the stream
/// kinds it serves (comma-separated numbers); agents without the header serve HTTP/1.1 streams only.
fn serves_http_heads(headers: &HeaderMap) -> bool {
    let wanted = kind::HTTP_HEADS.to_string();
    header_str(headers, "tether-stream-kinds")
        .is_some_and(|v| v.split(',').any(|k| k.trim() == wanted))
}

fn agent_version(headers: &HeaderMap) -> String {
    match header_str(headers, "tether-agent-version") {
        Some(v) if v.len() <= 64 && v.bytes().all(|b| b.is_ascii_graphic()) => v.to_owned(),
        Some(_) => "invalid".to_owned(),
        None => "unknown".to_owned(),
    }
}

/// Checks the client certificate of a tunnel request for `cluster`: it names the cluster, is its current
/// identity (a certificate a renewal replaced is refused at once), and has not expired. Returns what it read
/// from it.
async fn authenticate(
    shared: &Shared,
    client_cert: Option<&[u8]>,
    cluster: &str,
) -> Result<PeerCert, ApiError> {
    if !auth::valid_cluster_name(cluster) {
        return Err(ApiError::unauthorized(
            "the Tether-Cluster header must name the cluster (a DNS label)",
        ));
    }
    let Some(cert) = client_cert else {
        return Err(ApiError::unauthorized(NO_CLIENT_CERT));
    };
    let peer = identity::parse_peer(cert).map_err(ApiError::unauthorized)?;
    if !peer.names(cluster) {
        return Err(ApiError::unauthorized(format!(
            "the client certificate is not an identity of cluster {cluster}"
        )));
    }
    let identity = shared
        .store
        .cluster(cluster)
        .await?
        .and_then(|record| record.identity);
    match identity {
        Some(id) if id.accepts(&peer.fingerprint) => {}
        Some(id) if id.was_replaced(&peer.fingerprint) => {
            return Err(ApiError::unauthorized(REPLACED_IDENTITY));
        }
        _ => return Err(ApiError::unauthorized(BAD_IDENTITY)),
    }
    if peer.not_after <= OffsetDateTime::now_utc() {
        return Err(ApiError::identity_expired(cluster, peer.not_after));
    }
    Ok(peer)
}

/// The agent process's id from `Tether-Agent-Instance` (the same as its `hello.instance`), when printable and
/// short; empty otherwise.
fn agent_instance(headers: &HeaderMap) -> String {
    match header_str(headers, "tether-agent-instance") {
        Some(v) if v.len() <= 64 && v.bytes().all(|b| b.is_ascii_graphic()) => v.to_owned(),
        _ => String::new(),
    }
}

/// Takes a place for a new tunnel of `cluster` in the registry, or refuses it (the cluster holds
/// `--max-tunnels-per-cluster` tunnels here already): the established tunnels are kept, and the refusal is
/// logged as a warning naming the cluster, the agent instance and its address (a second agent with the same
/// identity, a stolen certificate, or an agent leaking tunnels).
fn reserve(
    shared: &Arc<Shared>,
    cluster: &str,
    instance: &str,
    peer: std::net::SocketAddr,
) -> Result<Reservation, ApiError> {
    shared.registry.reserve(cluster).map_err(|full| {
        tracing::warn!(
            cluster,
            instance = if instance.is_empty() { "unknown" } else { instance },
            %peer,
            max = full.max,
            "agent tunnel refused: the cluster holds its bound of tunnels at this replica; keeping the established ones"
        );
        ApiError::too_many_tunnels(cluster, full.max)
    })
}

/// `GET /agent/v1/tunnel`: authenticates the agent by its client certificate, then upgrades to WebSocket and
/// starts the tunnel.
pub(crate) async fn tunnel(
    shared: &Arc<Shared>,
    ctx: ConnCtx,
    mut req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let cluster = header_str(req.headers(), "tether-cluster")
        .unwrap_or_default()
        .to_owned();
    let client_cert = ctx.client_cert.as_deref().map(|c| c.as_ref());
    let peer = match authenticate(shared, client_cert, &cluster).await {
        Ok(peer) => peer,
        Err(e) => {
            tracing::info!(cluster = %cluster, peer = %ctx.peer, reason = e.reason, error = %e.message, "agent tunnel refused");
            return Err(e);
        }
    };
    if shared.is_shutting_down() {
        return Err(ApiError::shutting_down());
    }
    let version = agent_version(req.headers());
    let http_heads = serves_http_heads(req.headers());
    let instance = agent_instance(req.headers());
    let switch = ws::upgrade_response(&req).map_err(ApiError::bad_request)?;
    let reservation = reserve(shared, &cluster, &instance, ctx.peer)?;
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
        let session = task_shared.config.tunnel_session();
        let conn = ws::accept_upgraded(TokioIo::new(upgraded), session);
        let new = NewTunnel {
            cluster,
            version,
            cert: peer,
            peer: ctx.peer,
            instance,
            reservation,
            http_heads,
        };
        tunnels::run(&task_shared, new, conn).await;
        drop(ctx);
    });
    let (parts, ()) = switch.into_parts();
    Ok(Response::from_parts(parts, crate::body::empty()))
}

/// `GET /agent/v1/check`: the tunnel's authentication without the tunnel, for `tether-agent doctor`. The same
/// checks as `GET /agent/v1/tunnel` (client certificate naming the `Tether-Cluster`, the cluster's current
/// identity, not expired) and the same refusals; on success 200 with what the relay read and its own clock
/// (`relayTime`), and no tunnel is opened, so a running agent is not disturbed.
pub(crate) async fn check(
    shared: &Shared,
    ctx: &ConnCtx,
    req: &Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let cluster = header_str(req.headers(), "tether-cluster").unwrap_or_default();
    let client_cert = ctx.client_cert.as_deref().map(|c| c.as_ref());
    let peer = match authenticate(shared, client_cert, cluster).await {
        Ok(peer) => peer,
        Err(e) => {
            tracing::info!(cluster = %cluster, peer = %ctx.peer, reason = e.reason, error = %e.message, "agent identity check refused");
            return Err(e);
        }
    };
    let format = |t: OffsetDateTime| {
        t.format(&Rfc3339)
            .map_err(|e| ApiError::internal(format!("cannot format a time: {e}")))
    };
    Ok(respond::json(
        StatusCode::OK,
        &json!({
            "cluster": cluster,
            "fingerprint": peer.fingerprint,
            "notAfter": format(peer.not_after)?,
            "relayTime": format(OffsetDateTime::now_utc())?,
        }),
    ))
}

/// A QUIC tunnel whose handshake is done: authenticates it exactly as [`tunnel`] does (the client certificate
/// from the QUIC handshake, the cluster from the HELLO), then accepts it and starts the tunnel; or refuses it
/// with the Kubernetes `Status` the WebSocket path would answer, as the reason (code REFUSED).
pub(crate) async fn quic_tunnel(shared: &Arc<Shared>, pending: quic::PendingTunnel) {
    let cluster = header_str(pending.headers(), "tether-cluster")
        .unwrap_or_default()
        .to_owned();
    let remote = pending.remote_address();
    let client_cert = pending.peer_certificates().first().map(|c| c.as_ref());
    let peer = match authenticate(shared, client_cert, &cluster).await {
        Ok(peer) => peer,
        Err(e) => {
            tracing::info!(cluster = %cluster, peer = %remote, reason = e.reason, error = %e.message, transport = "quic", "agent tunnel refused");
            pending.refuse(code::REFUSED, &e.status_json().to_string());
            return;
        }
    };
    if shared.is_shutting_down() {
        let e = ApiError::shutting_down();
        pending.refuse(code::SHUTDOWN, &e.status_json().to_string());
        return;
    }
    let version = agent_version(pending.headers());
    let http_heads = serves_http_heads(pending.headers());
    let instance = agent_instance(pending.headers());
    let reservation = match reserve(shared, &cluster, &instance, remote) {
        Ok(reservation) => reservation,
        Err(e) => {
            pending.refuse(code::REFUSED, &e.status_json().to_string());
            return;
        }
    };
    let conn = match pending.accept().await {
        Ok(conn) => conn,
        Err(e) => {
            tracing::info!(cluster = %cluster, peer = %remote, error = %e, "QUIC tunnel lost before it started");
            return;
        }
    };
    let task_shared = shared.clone();
    shared.tasks.spawn(async move {
        let new = NewTunnel {
            cluster,
            version,
            cert: peer,
            peer: remote,
            instance,
            reservation,
            http_heads,
        };
        tunnels::run(&task_shared, new, conn).await;
    });
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

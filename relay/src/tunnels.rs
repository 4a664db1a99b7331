//! The life of one agent tunnel, from registration to removal: its streams (only the control channel is
//! accepted), its control channel, the expiry of its identity, and the moment it stops taking new requests
//! (GOAWAY from the agent, which is moving it, or from the relay).

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use tether_tunnel::{Connection, code, kind};
use time::OffsetDateTime;
use tokio::sync::watch;

use crate::control;
use crate::identity::PeerCert;
use crate::registry::{Reservation, Tunnel, TunnelInfo};
use crate::replicas;
use crate::state::Shared;

/// An authenticated tunnel about to start.
pub(crate) struct NewTunnel {
    pub(crate) cluster: String,
    /// The agent's version (`Tether-Agent-Version`).
    pub(crate) version: String,
    /// What the agent's certificate says.
    pub(crate) cert: PeerCert,
    /// The agent's address.
    pub(crate) peer: SocketAddr,
    /// The agent process's id (`Tether-Agent-Instance`), when it sent one.
    pub(crate) instance: String,
    /// Its place in the registry.
    pub(crate) reservation: Reservation,
    /// The agent serves streams of kind `HTTP_HEADS` (`Tether-Stream-Kinds`).
    pub(crate) http_heads: bool,
}

/// Accepts the agent's streams: the first CONTROL stream is served, any other stream is refused. Returns when
/// the tunnel stops accepting (GOAWAY from either side, or closed).
async fn accept_streams(
    shared: Arc<Shared>,
    cluster: String,
    tunnel: Tunnel,
    valid_until: watch::Sender<OffsetDateTime>,
) -> Option<tokio::task::JoinHandle<()>> {
    let mut valid_until = Some(valid_until);
    let mut control_task = None;
    while let Some(incoming) = tunnel.conn.accept().await {
        if incoming.kind != kind::CONTROL {
            incoming.refuse(
                code::UNSUPPORTED_KIND,
                "the relay accepts only a control stream from agents",
            );
            continue;
        }
        let Some(valid_until) = valid_until.take() else {
            incoming.refuse(
                code::REFUSED,
                "a control channel is already open on this tunnel",
            );
            continue;
        };
        match incoming.accept(Bytes::new()) {
            Ok(stream) => {
                let channel = control::Channel {
                    shared: shared.clone(),
                    cluster: cluster.clone(),
                    held_fingerprint: tunnel.info.fingerprint(),
                    valid_until,
                    draining: tunnel.draining.clone(),
                    tunnel: tunnel.clone(),
                };
                control_task = Some(tokio::spawn(control::serve(channel, stream)));
            }
            Err(e) => tracing::debug!(cluster, error = %e, "control stream failed to open"),
        }
    }
    control_task
}

/// Lets the control channel of a closed tunnel say goodbye (`draining`, bounded in `control::serve`), then
/// ends it.
async fn end_control(task: Option<tokio::task::JoinHandle<()>>) {
    let Some(mut task) = task else {
        return;
    };
    if tokio::time::timeout(CONTROL_GOODBYE, &mut task)
        .await
        .is_err()
    {
        task.abort();
    }
}

/// How long a control channel may outlive its tunnel (it needs at most two seconds).
const CONTROL_GOODBYE: std::time::Duration = std::time::Duration::from_secs(3);

/// Owns one agent tunnel from registration to removal.
pub(crate) async fn run(shared: &Arc<Shared>, new: NewTunnel, conn: Connection) {
    let NewTunnel {
        cluster,
        version,
        cert,
        peer,
        instance,
        reservation,
        http_heads,
    } = new;
    let cluster = cluster.as_str();
    let info = TunnelInfo::new(
        peer,
        &instance,
        &cert.fingerprint,
        shared.watches_end.child_token(),
    )
    .with_http_heads(http_heads);
    let tunnel = shared.registry.insert(reservation, conn.clone(), info);
    let id = tunnel.id;
    // A delete that ran between authentication and registration must still win.
    if !matches!(shared.store.cluster(cluster).await, Ok(Some(_))) {
        shared.registry.remove_if(cluster, id);
        conn.close(code::REFUSED, "cluster deleted at the relay");
        return;
    }
    // The other replicas route to it from now on.
    if replicas::publish(shared, cluster, &tunnel).await.is_err() {
        shared.registry.remove_if(cluster, id);
        conn.close(code::REFUSED, "cluster deleted at the relay");
        return;
    }
    tracing::info!(cluster, agent_version = %version, %peer, instance = %instance, tunnel = id, transport = conn.transport().as_str(), "agent tunnel connected");
    if let Err(e) = shared
        .store
        .record_connected(cluster, &version, OffsetDateTime::now_utc())
        .await
    {
        tracing::warn!(cluster, error = %e, "cannot record the connection");
    }

    let (valid_until, mut expiry) = watch::channel(cert.not_after);
    let acceptor = tokio::spawn(accept_streams(
        shared.clone(),
        cluster.to_owned(),
        tunnel.clone(),
        valid_until,
    ));
    let mut acceptor = Some(acceptor);
    let mut control = None;

    let closed = conn.closed();
    tokio::pin!(closed);
    let mut closing = false;
    let close_info = loop {
        let until = *expiry.borrow_and_update();
        let left = until - OffsetDateTime::now_utc();
        let left = std::time::Duration::try_from(left).unwrap_or_default();
        tokio::select! {
            info = &mut closed => break info,
            // A renewal moved the expiry: wait for the new one.
            Ok(()) = expiry.changed() => {}
            () = tokio::time::sleep(left), if !closing => {
                if *expiry.borrow() <= OffsetDateTime::now_utc() {
                    closing = true;
                    tracing::info!(cluster, tunnel = id, "closing the tunnel: the cluster's identity expired");
                    conn.close(code::REFUSED, "the cluster's identity expired");
                }
            }
            done = async {
                match acceptor.as_mut() {
                    Some(a) => a.await,
                    None => std::future::pending().await,
                }
            }, if acceptor.is_some() => {
                acceptor = None;
                control = done.ok().flatten();
                // The tunnel takes no new streams: the agent sent GOAWAY (it is moving the tunnel, or stopping)
                // or the relay did. Its streams in flight go on.
                tunnel.info.mark_going_away();
                if !conn.is_closed() {
                    tracing::info!(cluster, tunnel = id, open_streams = conn.open_streams(), "the tunnel takes no new requests (GOAWAY)");
                    let _ = replicas::publish(shared, cluster, &tunnel).await;
                }
            }
        }
    };
    if let Some(acceptor) = acceptor {
        acceptor.abort();
    }
    end_control(control).await;
    let last =
        shared.registry.remove_if(cluster, id) && shared.registry.tunnels(cluster).is_empty();
    replicas::unpublish(shared, cluster, id).await;
    match &close_info.error {
        None => tracing::info!(cluster, tunnel = id, "agent tunnel closed"),
        Some(e) => tracing::info!(cluster, tunnel = id, error = %e, "agent tunnel lost"),
    }
    if last && let Err(e) = shared.store.record_disconnected(cluster).await {
        tracing::warn!(cluster, error = %e, "cannot record the disconnection");
    }
}

//! The life of one agent tunnel, from registration to removal: its streams (only the control channel is
//! accepted), its control channel, the expiry of its identity.

use std::sync::Arc;

use bytes::Bytes;
use tether_tunnel::{Connection, code, kind};
use time::OffsetDateTime;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::control;
use crate::identity::PeerCert;
use crate::state::Shared;

/// Accepts the agent's streams: the first CONTROL stream is served, any other stream is refused.
async fn accept_streams(
    shared: Arc<Shared>,
    cluster: String,
    peer: PeerCert,
    conn: Connection,
    valid_until: watch::Sender<OffsetDateTime>,
    draining: CancellationToken,
) {
    let mut valid_until = Some(valid_until);
    let mut control_task = None;
    while let Some(incoming) = conn.accept().await {
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
                    held_fingerprint: peer.fingerprint.clone(),
                    valid_until,
                    draining: draining.clone(),
                };
                control_task = Some(tokio::spawn(control::serve(channel, stream)));
            }
            Err(e) => tracing::debug!(cluster, error = %e, "control stream failed to open"),
        }
    }
    if let Some(mut task) = control_task {
        // A tunnel going away lets its control channel say goodbye (`draining`, bounded in `control::serve`).
        if tokio::time::timeout(CONTROL_GOODBYE, &mut task)
            .await
            .is_err()
        {
            task.abort();
        }
    }
}

/// How long a control channel may outlive its tunnel's stream acceptor (it needs at most two seconds).
const CONTROL_GOODBYE: std::time::Duration = std::time::Duration::from_secs(3);

/// Owns one agent tunnel from registration to removal.
pub(crate) async fn run(
    shared: &Arc<Shared>,
    cluster: &str,
    version: &str,
    peer: &PeerCert,
    conn: Connection,
) {
    let (tunnel, replaced) = shared.registry.insert(cluster, conn.clone());
    let id = tunnel.id;
    if let Some(old) = replaced {
        old.go_away(
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

    let (valid_until, mut expiry) = watch::channel(peer.not_after);
    let acceptor = tokio::spawn(accept_streams(
        shared.clone(),
        cluster.to_owned(),
        peer.clone(),
        conn.clone(),
        valid_until,
        tunnel.draining.clone(),
    ));

    let closed = conn.closed();
    tokio::pin!(closed);
    let mut closing = false;
    let info = loop {
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
                    tracing::info!(cluster, "closing the tunnel: the cluster's identity expired");
                    conn.close(code::REFUSED, "the cluster's identity expired");
                }
            }
        }
    };
    acceptor.abort();
    let current = shared.registry.remove_if(cluster, id);
    match &info.error {
        None => tracing::info!(cluster, "agent tunnel closed"),
        Some(e) => tracing::info!(cluster, error = %e, "agent tunnel lost"),
    }
    if current && let Err(e) = shared.store.record_disconnected(cluster).await {
        tracing::warn!(cluster, error = %e, "cannot record the disconnection");
    }
}

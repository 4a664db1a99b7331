//! What a cluster's deletion or a renewal of its certificate does to the tunnels this replica holds, wherever
//! the change was made (here, through the admin API or a control channel; at another replica, learnt from the
//! store's change feed).
//!
//! - Deleted: the identity is revoked; every tunnel of the cluster is closed at once (code REFUSED, so the
//!   agent does not take it for a graceful GOAWAY).
//! - Renewed: the replaced certificate is refused for new tunnels at once (`handlers::agent`); tunnels still
//!   up with it are closed after `--replaced-identity-grace`, time for the agent to move them (make before
//!   break). The tunnel whose control channel received the new certificate holds it, and stays.

use std::time::Duration;

use tether_tunnel::code;

use crate::registry::Tunnel;
use crate::state::Shared;

/// The cluster was deleted: forget what is cached about it and close its tunnels here.
pub(crate) fn close_deleted(shared: &Shared, cluster: &str) {
    shared.activity.forget(cluster);
    shared.guard.forget(cluster);
    for tunnel in shared.registry.remove(cluster) {
        tracing::info!(
            cluster,
            tunnel = tunnel.id,
            "closing the tunnel: the cluster was deleted"
        );
        tunnel
            .conn
            .close(code::REFUSED, "cluster deleted at the relay");
    }
}

/// The cluster's current certificate is `current`: schedules the close of its tunnels here that hold another
/// one (once per tunnel).
pub(crate) fn close_replaced(shared: &Shared, cluster: &str, current: &str) {
    let grace = shared.config.replaced_identity_grace;
    for tunnel in shared.registry.tunnels(cluster) {
        if tunnel.info.fingerprint() != current && tunnel.info.mark_replaced() {
            tracing::info!(
                cluster,
                tunnel = tunnel.id,
                ?grace,
                "the tunnel's certificate was replaced by a renewal; closing it after the grace"
            );
            let cluster = cluster.to_owned();
            // Detached: holds only the tunnel, so it neither keeps the relay alive nor delays its shutdown.
            tokio::spawn(close_after(tunnel, cluster, current.to_owned(), grace));
        }
    }
}

async fn close_after(tunnel: Tunnel, cluster: String, current: String, grace: Duration) {
    tokio::select! {
        () = tokio::time::sleep(grace) => {}
        _ = tunnel.conn.closed() => return,
    }
    if tunnel.info.fingerprint() != current {
        tracing::info!(
            cluster,
            tunnel = tunnel.id,
            "closing a tunnel whose certificate was replaced by a renewal"
        );
        tunnel.conn.close(
            code::REFUSED,
            "the cluster's certificate was replaced by a renewal",
        );
    }
}

/// Brings this replica's tunnels of `cluster` in line with the store: closed when the cluster is gone, the
/// close of those holding a replaced certificate scheduled.
pub(crate) async fn check_cluster(shared: &Shared, cluster: &str) {
    match shared.store.cluster(cluster).await {
        Ok(None) => close_deleted(shared, cluster),
        Ok(Some(record)) => match record.identity {
            Some(identity) => close_replaced(shared, cluster, &identity.fingerprint),
            None => close_deleted(shared, cluster),
        },
        Err(e) => {
            tracing::warn!(cluster, error = %e, "cannot read the cluster to check its tunnels; will retry")
        }
    }
}

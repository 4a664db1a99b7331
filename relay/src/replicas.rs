//! This replica's life in the fleet, through the store: its lease (registered at start, renewed every third
//! of `--lease-ttl`, marked draining, removed at exit), the tunnels it holds as rows other replicas route by,
//! the reaping of replicas that died (their rows are ignored as soon as their lease lapses, and deleted one
//! TTL later by any live replica), and the change feed: what was changed through any replica reaches the
//! agents connected here ([`follow_changes`]). With SQLite the same code runs for the one replica.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::registry::Tunnel;
use crate::revocation;
use crate::state::Shared;
use crate::store::{
    Backend, ChangeFeed, ChangeKind, ClusterChange, FeedEvent, ReplicaLease, StoreError,
    TunnelRecord,
};

/// How often the change feed re-reads the log even without a notification (a lost NOTIFY, or SQLite changes
/// made by another process): the bound on how late a change reaches the agents here.
const FEED_RESYNC: Duration = Duration::from_secs(1);

/// How long to wait before trying the store again after the feed failed.
const FEED_RETRY: Duration = Duration::from_secs(1);

/// How often the change log is pruned, and how much of it is kept.
const PRUNE_EVERY: Duration = Duration::from_secs(3600);

/// This replica's lease as it stands.
fn lease(shared: &Shared) -> ReplicaLease {
    ReplicaLease {
        id: shared.fleet.replica_id.clone(),
        peer_address: shared.fleet.peer_address.clone(),
        ttl: shared.config.lease_ttl,
        draining: shared.is_shutting_down(),
    }
}

/// The store's row for `tunnel` of `cluster`.
fn record(shared: &Shared, cluster: &str, tunnel: &Tunnel) -> TunnelRecord {
    TunnelRecord {
        replica: shared.fleet.replica_id.clone(),
        tunnel_id: tunnel.id,
        cluster: cluster.to_owned(),
        agent_instance: tunnel.info.instance(),
        agent_tunnels: tunnel.info.said_tunnels(),
        transport: tunnel.conn.transport().as_str().to_owned(),
        agent_address: tunnel.info.peer.to_string(),
        connected_since: tunnel.since,
        usable: tunnel.is_usable(),
    }
}

/// Records (or updates) `tunnel` in the store, so that the other replicas route to it and show it. A store
/// failure is retried by the lease loop; [`StoreError::NotFound`] means the cluster is gone (the caller
/// closes the tunnel).
pub(crate) async fn publish(
    shared: &Shared,
    cluster: &str,
    tunnel: &Tunnel,
) -> Result<(), StoreError> {
    match shared
        .store
        .put_tunnel(&record(shared, cluster, tunnel))
        .await
    {
        Ok(()) => Ok(()),
        Err(e @ StoreError::NotFound(_)) => Err(e),
        Err(e) => {
            tracing::warn!(cluster, tunnel = tunnel.id, error = %e, "cannot record the tunnel in the store; will retry");
            shared.fleet.mark_dirty();
            Ok(())
        }
    }
}

/// Forgets `tunnel_id` of `cluster` in the store.
pub(crate) async fn unpublish(shared: &Shared, cluster: &str, tunnel_id: u64) {
    if let Err(e) = shared
        .store
        .remove_tunnel(&shared.fleet.replica_id, tunnel_id)
        .await
    {
        tracing::warn!(cluster, tunnel = tunnel_id, error = %e, "cannot remove the tunnel from the store; will retry");
        shared.fleet.mark_dirty();
    }
}

/// Registers this replica (at start: it holds no tunnel yet). On SQLite, which serves one relay process, any
/// other live replica is an earlier run of this one (SIGKILLed, its lease not yet lapsed): its rows go now, so
/// that its tunnels do not show as connected for the rest of its lease.
pub(crate) async fn register(shared: &Shared) -> Result<(), StoreError> {
    if shared.store.backend() == Backend::Sqlite {
        for earlier in shared.store.live_replicas().await? {
            if earlier.id != shared.fleet.replica_id {
                tracing::info!(replica = %earlier.id, "removing an earlier run's replica row (SQLite serves one relay)");
                shared.store.remove_replica(&earlier.id).await?;
            }
        }
    }
    shared.store.register_replica(&lease(shared)).await?;
    refresh_live(shared).await;
    tracing::info!(
        replica = %shared.fleet.replica_id,
        peer_address = shared.fleet.peer_address.as_deref().unwrap_or("none"),
        lease_ttl = ?shared.config.lease_ttl,
        live_replicas = shared.fleet.live_replicas(),
        "replica registered"
    );
    Ok(())
}

/// Registers again and writes every tunnel held here (the row was reaped while the store was out of reach,
/// or a tunnel write failed).
async fn rewrite(shared: &Shared) -> Result<(), StoreError> {
    shared.store.register_replica(&lease(shared)).await?;
    for (cluster, tunnel) in shared.registry.all() {
        match shared
            .store
            .put_tunnel(&record(shared, &cluster, &tunnel))
            .await
        {
            Ok(()) | Err(StoreError::NotFound(_)) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Renews the lease now (also to record the start of a drain at once), and reads how many replicas are live.
pub(crate) async fn renew(shared: &Shared) {
    let renewed = shared.store.renew_lease(&lease(shared)).await;
    let rewrite_needed = match renewed {
        Ok(true) => shared.fleet.take_dirty(),
        Ok(false) => {
            tracing::warn!(replica = %shared.fleet.replica_id, "this replica's lease had lapsed and was reaped; registering again");
            true
        }
        Err(e) => {
            tracing::warn!(replica = %shared.fleet.replica_id, error = %e, "cannot renew the lease; peers will ignore this replica once it lapses");
            return;
        }
    };
    if rewrite_needed && let Err(e) = rewrite(shared).await {
        tracing::warn!(error = %e, "cannot write this replica's tunnels to the store; will retry");
        shared.fleet.mark_dirty();
    }
    refresh_live(shared).await;
}

/// Reads the live replicas into [`crate::fleet::Fleet`].
async fn refresh_live(shared: &Shared) {
    match shared.store.live_replicas().await {
        Ok(replicas) => {
            let me = &shared.fleet.replica_id;
            let live = u32::try_from(replicas.len()).unwrap_or(u32::MAX);
            let peers = replicas
                .iter()
                .any(|r| &r.id != me && !r.draining && r.peer_address.is_some());
            shared.fleet.set_live(live, peers);
        }
        Err(e) => tracing::debug!(error = %e, "cannot read the live replicas"),
    }
}

/// Renews the lease every third of its TTL, reaps replicas whose lease lapsed a TTL ago, and prunes the
/// change log hourly, until `stop`.
pub(crate) async fn lease_loop(shared: Arc<Shared>, stop: CancellationToken) {
    let ttl = shared.config.lease_ttl;
    let mut tick = tokio::time::interval(ttl / 3);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut prune = tokio::time::interval(PRUNE_EVERY);
    prune.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {
                renew(&shared).await;
                match shared.store.reap_replicas(ttl).await {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(replicas = n, "removed replicas whose lease lapsed, with their tunnels"),
                    Err(e) => tracing::debug!(error = %e, "cannot reap lapsed replicas"),
                }
            }
            _ = prune.tick() => {
                let before = time::OffsetDateTime::now_utc() - PRUNE_EVERY;
                if let Err(e) = shared.store.prune_changes(before).await {
                    tracing::debug!(error = %e, "cannot prune the change log");
                }
            }
        }
    }
}

/// Removes this replica and its tunnels from the store (at exit).
pub(crate) async fn leave(shared: &Shared) {
    match shared.store.remove_replica(&shared.fleet.replica_id).await {
        Ok(()) => {
            tracing::info!(replica = %shared.fleet.replica_id, "replica removed from the store")
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot remove this replica from the store; its lease will lapse")
        }
    }
}

/// Follows the store's change feed until `stop`: role and deny assignment changes wake the control channels
/// of the cluster's tunnels here (they read and push the new guard snapshot), a deletion closes its tunnels
/// here, a renewal schedules the close of its tunnels here that hold the replaced certificate. Changes made
/// through this replica come back too; acting on them again is harmless.
pub(crate) async fn follow_changes(shared: Arc<Shared>, stop: CancellationToken) {
    loop {
        let subscribed = tokio::select! {
            () = stop.cancelled() => return,
            feed = ChangeFeed::subscribe(shared.store.clone(), FEED_RESYNC) => feed,
        };
        let mut feed = match subscribed {
            Ok(feed) => feed,
            Err(e) => {
                tracing::warn!(error = %e, "cannot follow the store's changes; will retry");
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(FEED_RETRY) => continue,
                }
            }
        };
        // Whatever changed before the subscription: bring the tunnels here in line once.
        resync(&shared).await;
        loop {
            let event = tokio::select! {
                () = stop.cancelled() => return,
                event = feed.next() => event,
            };
            match event {
                Ok(FeedEvent::Changes(changes)) => {
                    for change in changes {
                        apply(&shared, &change).await;
                    }
                }
                Ok(FeedEvent::Resync) => resync(&shared).await,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the store's changes; will retry");
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(FEED_RETRY) => {}
                    }
                }
            }
        }
    }
}

/// Acts on one change for the tunnels held here.
async fn apply(shared: &Shared, change: &ClusterChange) {
    let cluster = change.cluster.as_str();
    tracing::debug!(cluster, kind = ?change.kind, seq = change.seq, "store change");
    match change.kind {
        ChangeKind::Guard(version) => shared.guard.changed(cluster, version),
        ChangeKind::Deleted => revocation::close_deleted(shared, cluster),
        ChangeKind::Identity | ChangeKind::Created => {
            if !shared.registry.tunnels(cluster).is_empty() {
                revocation::check_cluster(shared, cluster).await;
            }
        }
        // Tags are read from the store whenever they are shown or filtered on: nothing here holds them.
        ChangeKind::Tags => {}
    }
}

/// Brings every cluster with tunnels here in line with the store: deleted ones closed, replaced
/// certificates scheduled to close, guard snapshots re-sent if newer.
async fn resync(shared: &Shared) {
    for cluster in shared.registry.clusters() {
        revocation::check_cluster(shared, &cluster).await;
        match shared.store.guard_state(&cluster).await {
            Ok(Some(state)) => shared.guard.changed(&cluster, state.version),
            Ok(None) => {}
            Err(e) => tracing::debug!(cluster, error = %e, "cannot read the guard snapshot"),
        }
    }
}

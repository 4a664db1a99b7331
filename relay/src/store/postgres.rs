//! The [`Store`] for a relay fleet: PostgreSQL through sqlx, shared by every replica.
//!
//! The statements are those of the SQLite store (shared in `rows.rs`) wherever the dialects agree; what
//! differs, and stays here, is how concurrent replicas are kept correct (PostgreSQL runs writers in
//! parallel, at READ COMMITTED here):
//! - single-row invariants are conditional `UPDATE`s, which PostgreSQL re-checks on the latest row version
//!   after waiting for a concurrent writer: an onboarding token is redeemed exactly once, a renewal needs the
//!   certificate that is current when it runs;
//! - every guard change first raises the cluster's snapshot version with an `UPDATE` of the cluster row, which
//!   locks it until commit, so the versions of one cluster grow in commit order and its assignments, deny
//!   assignments and deletion are serialized;
//! - uniqueness (cluster names, role ids and names, one role per principal and scope) is left to `UNIQUE`
//!   constraints, which make the second of two racing inserts wait and then fail;
//! - the change log's sequence comes from one counter row locked until commit (always the last lock a
//!   transaction takes, so it cannot deadlock), which keeps the log gapless and in commit order; the same
//!   transaction sends `NOTIFY tether_cluster_changes`, delivered only if it commits;
//! - multi-statement reads (guard state, change log) run at REPEATABLE READ, so they see one instant;
//! - rows are locked in a fixed order (cluster before its assignments, activity batches by name), and a
//!   transaction that still fails with a serialization failure or a deadlock is retried a few times.

use std::collections::BTreeMap;
use std::str::FromStr;
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use futures_util::stream::StreamExt;
use rand::RngExt as _;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgListener, PgPool, PgPoolOptions};
use tether_auth::rbac::{RoleDefinition, builtin_roles};
use time::OffsetDateTime;

use super::rows::*;
use super::{
    Activity, ChangeKind, ChangePage, ChangeSignals, ClusterMetadata, ClusterRecord,
    ClusterSecrets, DenyAssignmentRecord, DirectoryEntry, GuardState, NewCluster, NewIdentity,
    ReplicaLease, ReplicaRecord, RoleAssignmentRecord, Store, StoreError, StoreFuture, TokenHash,
    TunnelRecord, TunnelRoute, next_guard_version,
};

/// Starts a read transaction that sees one snapshot for all its statements.
const BEGIN_SNAPSHOT: &str = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY";

/// The channel change notifications are sent on.
const CHANNEL: &str = "tether_cluster_changes";

/// How many times a transaction that failed with a serialization failure or a deadlock is run in all.
const ATTEMPTS: u32 = 5;

/// PostgreSQL implementation of [`Store`].
#[derive(Debug, Clone)]
pub struct PostgresStore {
    pool: PgPool,
    options: PgConnectOptions,
}

impl PostgresStore {
    /// Connects to the database at `url` (`postgres://…` or `postgresql://…`, with the usual parameters such as
    /// `sslmode`) and applies the migrations (serialized between replicas by sqlx's advisory lock).
    pub async fn open(url: &str) -> Result<Self, StoreError> {
        let options = PgConnectOptions::from_str(url)?.application_name("tether-relay");
        Self::open_with(options, 8).await
    }

    /// Like [`PostgresStore::open`], with parsed options and a pool of at most `max_connections`.
    pub async fn open_with(
        options: PgConnectOptions,
        max_connections: u32,
    ) -> Result<Self, StoreError> {
        let pool = PgPoolOptions::new()
            .max_connections(max_connections.max(1))
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options.clone())
            .await?;
        sqlx::migrate!("./migrations/postgres")
            .run(&pool)
            .await
            .map_err(StoreError::Migrate)?;
        // The built-in roles are rows too, so that every assignment references its role by foreign key.
        for role in builtin_roles() {
            sqlx::query(INSERT_BUILTIN_ROLE)
                .bind(&role.id)
                .bind(role.id.to_ascii_lowercase())
                .bind(role.name.to_ascii_lowercase())
                .bind(true)
                .execute(&pool)
                .await?;
        }
        Ok(Self { pool, options })
    }

    /// One attempt at writing an activity batch (sorted by name).
    async fn write_activity(&self, batch: &[&Activity]) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        for a in batch {
            bind_activity(sqlx::query(RECORD_ACTIVITY), a)?
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }
}

/// True for the errors after which running the whole transaction again can succeed.
fn is_transient(e: &StoreError) -> bool {
    let StoreError::Database(e) = e else {
        return false;
    };
    // 40001 serialization_failure, 40P01 deadlock_detected.
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|code| code == "40001" || code == "40P01")
}

/// Runs `op` (one whole transaction) again after a serialization failure or deadlock, a few times, with a
/// short randomized pause so that the contenders do not collide again in lockstep.
async fn retry<'a, T>(
    mut op: impl FnMut() -> BoxFuture<'a, Result<T, StoreError>>,
) -> Result<T, StoreError> {
    let mut attempt = 1;
    loop {
        match op().await {
            Err(e) if attempt < ATTEMPTS && is_transient(&e) => {
                let pause = rand::rng().random_range(1..=5u64 << attempt);
                tracing::debug!(attempt, error = %e, "retrying a store transaction");
                tokio::time::sleep(Duration::from_millis(pause)).await;
                attempt += 1;
            }
            result => return result,
        }
    }
}

/// Appends `kind` for `cluster` to the change log, inside the transaction that makes the change.
async fn record_change(
    conn: &mut PgConnection,
    cluster: &str,
    kind: ChangeKind,
    at: OffsetDateTime,
) -> Result<u64, StoreError> {
    let seq = append_change(&mut *conn, cluster, kind, at).await?;
    // Delivered to listeners when (and only if) the transaction commits.
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(CHANNEL)
        .bind(seq.to_string())
        .execute(&mut *conn)
        .await?;
    version_from_db(seq)
}

// The shared inserts and reads. Here `bump_guard_version`'s UPDATE keeps the cluster row locked until commit:
// concurrent guard changes and the deletion of this cluster wait for it, and the `CASE` is evaluated on the
// latest committed version, so versions only grow.
connection_statements!(PgConnection);

impl PostgresStore {
    /// Deletes the role or deny assignment `id` (`find` reads its cluster, `delete` removes it from that
    /// cluster) with a version raise and a change log entry; its cluster and the new version.
    fn delete_assignment<'a>(
        &'a self,
        find: &'static str,
        delete: &'static str,
        id: &'a str,
    ) -> StoreFuture<'a, Option<(String, u64)>> {
        retry(move || {
            async move {
                let mut tx = self.pool.begin().await?;
                // The cluster row is locked before the assignment row, the order a cluster deletion (which
                // cascades to its assignments) takes them in.
                let cluster: Option<String> = sqlx::query_scalar(find)
                    .bind(id)
                    .fetch_optional(&mut *tx)
                    .await?;
                let Some(cluster) = cluster else {
                    return Ok(None);
                };
                let Some(version) = bump_guard_version(&mut tx, &cluster).await? else {
                    return Ok(None);
                };
                let deleted = sqlx::query(delete)
                    .bind(id)
                    .bind(&cluster)
                    .execute(&mut *tx)
                    .await?;
                if deleted.rows_affected() == 0 {
                    // Removed concurrently: roll back the version raise.
                    return Ok(None);
                }
                let now = OffsetDateTime::now_utc();
                record_change(&mut tx, &cluster, ChangeKind::Guard(version), now).await?;
                tx.commit().await?;
                Ok(Some((cluster, version)))
            }
            .boxed()
        })
        .boxed()
    }
}

impl Store for PostgresStore {
    // The operations that are one statement on the pool, the same in both dialects.
    pool_statements!();

    fn backend(&self) -> super::Backend {
        super::Backend::Postgres
    }
    // Replica leases and the tunnels each replica holds, with this database's clock.
    fleet_statements!("CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)");

    fn create_cluster<'a>(&'a self, new: &'a NewCluster) -> StoreFuture<'a, ClusterRecord> {
        retry(move || {
            async move {
                let mut tx = self.pool.begin().await?;
                write_new_cluster(&mut tx, new, &[], &[], &[]).await?;
                tx.commit().await?;
                new_record(new)
            }
            .boxed()
        })
        .boxed()
    }

    fn delete_cluster<'a>(&'a self, name: &'a str) -> StoreFuture<'a, bool> {
        retry(move || {
            async move {
                let mut tx = self.pool.begin().await?;
                let done = sqlx::query(DELETE_CLUSTER)
                    .bind(name)
                    .execute(&mut *tx)
                    .await?;
                if done.rows_affected() == 0 {
                    return Ok(false);
                }
                record_change(
                    &mut tx,
                    name,
                    ChangeKind::Deleted,
                    OffsetDateTime::now_utc(),
                )
                .await?;
                tx.commit().await?;
                Ok(true)
            }
            .boxed()
        })
        .boxed()
    }

    fn renew_identity<'a>(
        &'a self,
        name: &'a str,
        presented: &'a str,
        identity: &'a NewIdentity,
    ) -> StoreFuture<'a, bool> {
        retry(move || {
            async move {
                let mut tx = self.pool.begin().await?;
                let renewed = write_renewal(&mut tx, name, presented, identity).await?;
                tx.commit().await?;
                Ok(renewed)
            }
            .boxed()
        })
        .boxed()
    }

    fn record_activity<'a>(&'a self, batch: &'a [Activity]) -> StoreFuture<'a, ()> {
        async move {
            if batch.is_empty() {
                return Ok(());
            }
            // Replicas write overlapping batches (an agent keeps tunnels to two of them): locking the rows in
            // name order keeps two batches from waiting on each other crosswise.
            let mut sorted: Vec<&Activity> = batch.iter().collect();
            sorted.sort_by(|a, b| a.name.cmp(&b.name));
            retry(|| self.write_activity(&sorted).boxed()).await
        }
        .boxed()
    }

    fn create_role_assignment<'a>(
        &'a self,
        assignment: &'a RoleAssignmentRecord,
    ) -> StoreFuture<'a, u64> {
        retry(move || {
            async move {
                let mut tx = self.pool.begin().await?;
                let version = add_role_assignment(&mut tx, assignment).await?;
                tx.commit().await?;
                Ok(version)
            }
            .boxed()
        })
        .boxed()
    }

    fn delete_role_assignment<'a>(&'a self, id: &'a str) -> StoreFuture<'a, Option<(String, u64)>> {
        self.delete_assignment(
            "SELECT cluster FROM role_assignments WHERE id = $1",
            "DELETE FROM role_assignments WHERE id = $1 AND cluster = $2",
            id,
        )
    }

    fn create_deny_assignment<'a>(
        &'a self,
        deny: &'a DenyAssignmentRecord,
    ) -> StoreFuture<'a, u64> {
        retry(move || {
            async move {
                let mut tx = self.pool.begin().await?;
                let version = add_deny_assignment(&mut tx, deny).await?;
                tx.commit().await?;
                Ok(version)
            }
            .boxed()
        })
        .boxed()
    }

    fn delete_deny_assignment<'a>(&'a self, id: &'a str) -> StoreFuture<'a, Option<(String, u64)>> {
        self.delete_assignment(
            "SELECT cluster FROM deny_assignments WHERE id = $1",
            "DELETE FROM deny_assignments WHERE id = $1 AND cluster = $2",
            id,
        )
    }

    fn guard_state<'a>(&'a self, cluster: &'a str) -> StoreFuture<'a, Option<GuardState>> {
        async move {
            // One read transaction: the version and the contents are from the same instant.
            let mut tx = self.pool.begin_with(BEGIN_SNAPSHOT).await?;
            let state = read_guard_state(&mut tx, cluster).await?;
            tx.commit().await?;
            Ok(state)
        }
        .boxed()
    }

    fn import_cluster<'a>(
        &'a self,
        new: &'a NewCluster,
        roles: &'a [RoleDefinition],
        assignments: &'a [RoleAssignmentRecord],
        denies: &'a [DenyAssignmentRecord],
    ) -> StoreFuture<'a, ClusterRecord> {
        retry(move || {
            async move {
                let mut tx = self.pool.begin().await?;
                write_new_cluster(&mut tx, new, roles, assignments, denies).await?;
                tx.commit().await?;
                new_record(new)
            }
            .boxed()
        })
        .boxed()
    }

    fn set_cluster_tags<'a>(
        &'a self,
        name: &'a str,
        tags: &'a BTreeMap<String, String>,
    ) -> StoreFuture<'a, bool> {
        retry(move || {
            async move {
                let mut tx = self.pool.begin().await?;
                let done = sqlx::query(SET_TAGS)
                    .bind(to_json(tags, "tags")?)
                    .bind(name)
                    .execute(&mut *tx)
                    .await?;
                if done.rows_affected() == 0 {
                    return Ok(false);
                }
                record_change(&mut tx, name, ChangeKind::Tags, OffsetDateTime::now_utc()).await?;
                tx.commit().await?;
                Ok(true)
            }
            .boxed()
        })
        .boxed()
    }

    fn changes_since(&self, after: u64, limit: u32) -> StoreFuture<'_, ChangePage> {
        async move {
            // One read transaction: the head, the pruning mark and the entries are from the same instant.
            let mut tx = self.pool.begin_with(BEGIN_SNAPSHOT).await?;
            let page = read_changes(&mut tx, after, limit).await?;
            tx.commit().await?;
            Ok(page)
        }
        .boxed()
    }

    fn prune_changes(&self, before: OffsetDateTime) -> StoreFuture<'_, u64> {
        retry(move || {
            async move {
                let mut tx = self.pool.begin().await?;
                let pruned = prune_log(&mut tx, before).await?;
                tx.commit().await?;
                Ok(pruned)
            }
            .boxed()
        })
        .boxed()
    }

    fn change_signals(&self) -> StoreFuture<'_, Option<ChangeSignals>> {
        async move {
            // A connection of its own (a pool of one, which PgListener uses to reconnect), not one of the
            // store's: it stays checked out for as long as the feed lives.
            let pool = PgPoolOptions::new()
                .max_connections(1)
                .min_connections(0)
                .idle_timeout(None)
                .max_lifetime(None)
                .connect_with(self.options.clone())
                .await?;
            let mut listener = PgListener::connect_with(&pool).await?;
            listener.ignore_pool_close_event(true);
            listener.listen(CHANNEL).await?;
            let signals = futures_util::stream::unfold(listener, |mut listener| async move {
                // A lost connection is reconnected (and listens again) by the next call; what was sent
                // meanwhile is lost, so it counts as a wake-up too: the reader re-reads the log. A failed
                // reconnection is retried after a pause rather than ending the stream.
                loop {
                    match listener.try_recv().await {
                        Ok(_) => return Some(((), listener)),
                        Err(e) => {
                            tracing::warn!(error = %e, "store change listener failed; retrying");
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                    }
                }
            });
            Ok(Some(signals.boxed()))
        }
        .boxed()
    }
}

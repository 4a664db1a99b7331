//! The default [`Store`]: SQLite through sqlx, WAL mode, embedded migrations.
//!
//! Queries are plain runtime SQL with `$n` placeholders, which PostgreSQL understands too: the statements,
//! row decoding and one-statement methods both backends share live in `rows.rs`; this file keeps what only
//! SQLite does (the connection setup, `BEGIN IMMEDIATE` transactions, in-process change signals).
//!
//! Write transactions start with `BEGIN IMMEDIATE`: they take SQLite's write lock first, so two handles on one
//! file (two pools, or two processes) wait for each other (busy timeout) instead of failing to upgrade a read
//! lock. Changes through this handle also wake its [`Store::change_signals`] subscribers; changes made through
//! another handle are found by the change feed's periodic re-read.

use std::collections::BTreeMap;
use std::str::FromStr;
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::stream::StreamExt;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteSynchronous,
};
use tether_auth::rbac::{RoleDefinition, builtin_roles};
use time::OffsetDateTime;
use tokio::sync::watch;

use super::rows::*;
use super::{
    Activity, ChangeKind, ChangePage, ChangeSignals, ClusterMetadata, ClusterRecord,
    ClusterSecrets, DenyAssignmentRecord, DirectoryEntry, GuardState, NewCluster, NewIdentity,
    ReplicaLease, ReplicaRecord, RoleAssignmentRecord, Store, StoreError, StoreFuture, TokenHash,
    TunnelRecord, TunnelRoute, next_guard_version,
};

/// Starts a write transaction holding the write lock.
const BEGIN_WRITE: &str = "BEGIN IMMEDIATE";

/// SQLite implementation of [`Store`].
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    /// Bumped after each commit that logged a change through this handle.
    changed: watch::Sender<u64>,
}

impl SqliteStore {
    /// Opens (creating if missing) the database at `url` (`sqlite://PATH` or `sqlite::memory:`) and applies
    /// the migrations.
    pub async fn open(url: &str) -> Result<Self, StoreError> {
        let options = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(5))
            .foreign_keys(true);
        let in_memory = url.contains(":memory:");
        let pool_options = if in_memory {
            // Every connection to `:memory:` is a separate database: keep exactly one, forever.
            SqlitePoolOptions::new()
                .max_connections(1)
                .min_connections(1)
                .idle_timeout(None)
                .max_lifetime(None)
        } else {
            SqlitePoolOptions::new().max_connections(4)
        };
        let pool = pool_options.connect_with(options).await?;
        sqlx::migrate!("./migrations/sqlite")
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
        Ok(Self {
            pool,
            changed: watch::Sender::new(0),
        })
    }

    /// Wakes this handle's change subscribers (after a commit that logged a change).
    fn signal_change(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }
}

/// Appends `kind` for `cluster` to the change log, inside the transaction that makes the change.
async fn record_change(
    conn: &mut SqliteConnection,
    cluster: &str,
    kind: ChangeKind,
    at: OffsetDateTime,
) -> Result<u64, StoreError> {
    let seq = append_change(&mut *conn, cluster, kind, at).await?;
    version_from_db(seq)
}

// The shared inserts and reads. Here `bump_guard_version`, being the first write of its transaction, also
// takes the write lock before anything is read.
connection_statements!(SqliteConnection);

impl SqliteStore {
    /// Deletes the role or deny assignment `id` (`delete` removes it, returning its cluster) with a version
    /// raise and a change log entry; its cluster and the new version.
    fn delete_assignment<'a>(
        &'a self,
        delete: &'static str,
        id: &'a str,
    ) -> StoreFuture<'a, Option<(String, u64)>> {
        async move {
            let mut tx = self.pool.begin_with(BEGIN_WRITE).await?;
            let cluster: Option<String> = sqlx::query_scalar(delete)
                .bind(id)
                .fetch_optional(&mut *tx)
                .await?;
            let Some(cluster) = cluster else {
                return Ok(None);
            };
            let Some(version) = bump_guard_version(&mut tx, &cluster).await? else {
                return Ok(None);
            };
            let now = OffsetDateTime::now_utc();
            record_change(&mut tx, &cluster, ChangeKind::Guard(version), now).await?;
            tx.commit().await?;
            self.signal_change();
            Ok(Some((cluster, version)))
        }
        .boxed()
    }
}

impl Store for SqliteStore {
    // The operations that are one statement on the pool, the same in both dialects.
    pool_statements!();

    fn backend(&self) -> super::Backend {
        super::Backend::Sqlite
    }
    // Replica leases and the tunnels each replica holds, with this database's clock.
    fleet_statements!("CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)");

    fn create_cluster<'a>(&'a self, new: &'a NewCluster) -> StoreFuture<'a, ClusterRecord> {
        async move {
            let mut tx = self.pool.begin_with(BEGIN_WRITE).await?;
            write_new_cluster(&mut tx, new, &[], &[], &[]).await?;
            tx.commit().await?;
            self.signal_change();
            new_record(new)
        }
        .boxed()
    }

    fn delete_cluster<'a>(&'a self, name: &'a str) -> StoreFuture<'a, bool> {
        async move {
            let mut tx = self.pool.begin_with(BEGIN_WRITE).await?;
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
            self.signal_change();
            Ok(true)
        }
        .boxed()
    }

    fn renew_identity<'a>(
        &'a self,
        name: &'a str,
        presented: &'a str,
        identity: &'a NewIdentity,
    ) -> StoreFuture<'a, bool> {
        async move {
            let mut tx = self.pool.begin_with(BEGIN_WRITE).await?;
            let renewed = write_renewal(&mut tx, name, presented, identity).await?;
            tx.commit().await?;
            if renewed {
                self.signal_change();
            }
            Ok(renewed)
        }
        .boxed()
    }

    fn record_activity<'a>(&'a self, batch: &'a [Activity]) -> StoreFuture<'a, ()> {
        async move {
            if batch.is_empty() {
                return Ok(());
            }
            let mut tx = self.pool.begin_with(BEGIN_WRITE).await?;
            for a in batch {
                bind_activity(sqlx::query(RECORD_ACTIVITY), a)?
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
            Ok(())
        }
        .boxed()
    }

    fn create_role_assignment<'a>(
        &'a self,
        assignment: &'a RoleAssignmentRecord,
    ) -> StoreFuture<'a, u64> {
        async move {
            let mut tx = self.pool.begin_with(BEGIN_WRITE).await?;
            let version = add_role_assignment(&mut tx, assignment).await?;
            tx.commit().await?;
            self.signal_change();
            Ok(version)
        }
        .boxed()
    }

    fn delete_role_assignment<'a>(&'a self, id: &'a str) -> StoreFuture<'a, Option<(String, u64)>> {
        self.delete_assignment(
            "DELETE FROM role_assignments WHERE id = $1 RETURNING cluster",
            id,
        )
    }

    fn create_deny_assignment<'a>(
        &'a self,
        deny: &'a DenyAssignmentRecord,
    ) -> StoreFuture<'a, u64> {
        async move {
            let mut tx = self.pool.begin_with(BEGIN_WRITE).await?;
            let version = add_deny_assignment(&mut tx, deny).await?;
            tx.commit().await?;
            self.signal_change();
            Ok(version)
        }
        .boxed()
    }

    fn delete_deny_assignment<'a>(&'a self, id: &'a str) -> StoreFuture<'a, Option<(String, u64)>> {
        self.delete_assignment(
            "DELETE FROM deny_assignments WHERE id = $1 RETURNING cluster",
            id,
        )
    }

    fn guard_state<'a>(&'a self, cluster: &'a str) -> StoreFuture<'a, Option<GuardState>> {
        async move {
            // One read transaction: the version and the contents are from the same instant.
            let mut tx = self.pool.begin().await?;
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
        async move {
            let mut tx = self.pool.begin_with(BEGIN_WRITE).await?;
            write_new_cluster(&mut tx, new, roles, assignments, denies).await?;
            tx.commit().await?;
            self.signal_change();
            new_record(new)
        }
        .boxed()
    }

    fn set_cluster_tags<'a>(
        &'a self,
        name: &'a str,
        tags: &'a BTreeMap<String, String>,
    ) -> StoreFuture<'a, bool> {
        async move {
            let mut tx = self.pool.begin_with(BEGIN_WRITE).await?;
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
            self.signal_change();
            Ok(true)
        }
        .boxed()
    }

    fn changes_since(&self, after: u64, limit: u32) -> StoreFuture<'_, ChangePage> {
        async move {
            // One read transaction: the head, the pruning mark and the entries are from the same instant.
            let mut tx = self.pool.begin().await?;
            let page = read_changes(&mut tx, after, limit).await?;
            tx.commit().await?;
            Ok(page)
        }
        .boxed()
    }

    fn prune_changes(&self, before: OffsetDateTime) -> StoreFuture<'_, u64> {
        async move {
            let mut tx = self.pool.begin_with(BEGIN_WRITE).await?;
            let pruned = prune_log(&mut tx, before).await?;
            tx.commit().await?;
            Ok(pruned)
        }
        .boxed()
    }

    fn change_signals(&self) -> StoreFuture<'_, Option<ChangeSignals>> {
        async move {
            let mut rx = self.changed.subscribe();
            rx.mark_unchanged();
            let signals = futures_util::stream::unfold(rx, |mut rx| async move {
                rx.changed().await.ok()?;
                Some(((), rx))
            });
            Ok(Some(signals.boxed()))
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    // The backend-neutral cases live in tests/store.rs, run against SQLite and PostgreSQL; this is what only
    // SQLite has.
    use super::*;

    fn new_cluster(name: &str, token: &str) -> NewCluster {
        NewCluster {
            name: name.into(),
            tags: BTreeMap::from([("env".to_string(), "test".to_string())]),
            onboarding_token_hash: TokenHash::of(token),
            created_at: OffsetDateTime::from_unix_timestamp(1_700_000_000)
                .expect("valid timestamp"),
        }
    }

    #[tokio::test]
    async fn survives_reopen_on_disk() {
        let dir = tempfile::tempdir().expect("tempdir");
        let url = format!("sqlite://{}", dir.path().join("relay.db").display());
        let store = SqliteStore::open(&url).await.expect("open");
        store
            .create_cluster(&new_cluster("persisted", "token"))
            .await
            .expect("create");
        store.close().await.expect("close");
        let store = SqliteStore::open(&url).await.expect("reopen");
        assert!(store.cluster("persisted").await.expect("query").is_some());
        let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
            .fetch_one(&store.pool)
            .await
            .expect("pragma");
        assert_eq!(mode, "wal");
    }
}

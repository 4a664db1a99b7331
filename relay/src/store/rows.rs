//! What the SQLite and PostgreSQL stores share: the SQL text both dialects accept (`$n` placeholders, which
//! SQLite understands too), decoding rows into records through sqlx's generic [`Row`] trait, the
//! timestamp/JSON/version conversions, the mapping of constraint violations to [`StoreError`]s, and the
//! assembly of guard snapshots and change pages.
//!
//! What it does not do: run statements or open transactions. How a write is made safe against concurrent
//! writers (SQLite's `BEGIN IMMEDIATE`, PostgreSQL's row locks, retries and `NOTIFY`) stays in each backend.

use std::collections::BTreeMap;

use sqlx::error::ErrorKind;
use sqlx::query::Query;
use sqlx::{ColumnIndex, Database, Decode, Encode, Row, Type};
use tether_auth::rbac::RoleDefinition;
use time::OffsetDateTime;

use super::{
    Activity, ChangeKind, ChangePage, ClusterChange, ClusterIdentity, ClusterRecord,
    ClusterSecrets, DenyAssignmentRecord, DirectoryEntry, GuardState, NewCluster, ReplicaRecord,
    RoleAssignmentRecord, StoreError, TokenHash, TunnelRecord, TunnelRoute, next_guard_version,
};

/// The columns [`cluster_from_row`] reads (a macro so that queries stay static strings).
macro_rules! cluster_columns {
    () => {
        "name, tags, created_at, onboarding_used, connected_since, last_seen, agent_version, \
         identity_fingerprint, identity_not_after, previous_fingerprint, metadata, health"
    };
}

/// The columns [`assignment_from_row`] reads.
macro_rules! assignment_columns {
    () => {
        "id, role_id, principal_id, cluster, namespace, created_at"
    };
}

/// The [`Store`](super::Store) methods that are one statement on `self.pool`, identical for both backends:
/// expanded inside each backend's `impl Store`. A macro rather than functions generic over sqlx's `Pool<DB>`
/// because the pool types differ and the executor/encode/decode bounds of such functions would be longer than
/// the bodies. The expanding module provides `insert_role` and the imports the bodies name.
macro_rules! pool_statements {
    () => {
        fn cluster<'a>(&'a self, name: &'a str) -> StoreFuture<'a, Option<ClusterRecord>> {
            async move {
                let row = sqlx::query(SELECT_CLUSTER)
                    .bind(name)
                    .fetch_optional(&self.pool)
                    .await?;
                row.as_ref().map(cluster_from_row).transpose()
            }
            .boxed()
        }

        fn list_clusters(&self) -> StoreFuture<'_, Vec<ClusterRecord>> {
            async move {
                let rows = sqlx::query(LIST_CLUSTERS).fetch_all(&self.pool).await?;
                rows.iter().map(cluster_from_row).collect()
            }
            .boxed()
        }

        fn secrets<'a>(&'a self, name: &'a str) -> StoreFuture<'a, Option<ClusterSecrets>> {
            async move {
                let row = sqlx::query(SELECT_SECRETS)
                    .bind(name)
                    .fetch_optional(&self.pool)
                    .await?;
                row.as_ref().map(secrets_from_row).transpose()
            }
            .boxed()
        }

        fn redeem_onboarding_token<'a>(
            &'a self,
            name: &'a str,
            token: &'a TokenHash,
            identity: &'a NewIdentity,
            at: OffsetDateTime,
        ) -> StoreFuture<'a, bool> {
            async move {
                // One conditional UPDATE: two concurrent redemptions cannot both see the token unused.
                let done = sqlx::query(REDEEM_TOKEN)
                    .bind(true)
                    .bind(&identity.fingerprint)
                    .bind(ts(identity.not_after))
                    .bind(ts(at))
                    .bind(name)
                    .bind(token.to_hex())
                    .bind(false)
                    .execute(&self.pool)
                    .await?;
                Ok(done.rows_affected() == 1)
            }
            .boxed()
        }

        fn record_connected<'a>(
            &'a self,
            name: &'a str,
            agent_version: &'a str,
            at: OffsetDateTime,
        ) -> StoreFuture<'a, ()> {
            async move {
                sqlx::query(RECORD_CONNECTED)
                    .bind(ts(at))
                    .bind(ts(at))
                    .bind(agent_version)
                    .bind(name)
                    .execute(&self.pool)
                    .await?;
                Ok(())
            }
            .boxed()
        }

        fn record_metadata<'a>(
            &'a self,
            name: &'a str,
            metadata: &'a ClusterMetadata,
            agent_version: &'a str,
        ) -> StoreFuture<'a, ()> {
            async move {
                sqlx::query(RECORD_METADATA)
                    .bind(to_json(metadata, "metadata")?)
                    .bind(agent_version)
                    .bind(name)
                    .execute(&self.pool)
                    .await?;
                Ok(())
            }
            .boxed()
        }

        fn record_disconnected<'a>(&'a self, name: &'a str) -> StoreFuture<'a, ()> {
            async move {
                sqlx::query(RECORD_DISCONNECTED)
                    .bind(name)
                    .execute(&self.pool)
                    .await?;
                Ok(())
            }
            .boxed()
        }

        fn create_role_definition<'a>(
            &'a self,
            role: &'a RoleDefinition,
            at: OffsetDateTime,
        ) -> StoreFuture<'a, ()> {
            async move {
                let mut conn = self.pool.acquire().await?;
                insert_role(&mut conn, role, at, false).await
            }
            .boxed()
        }

        fn role_definitions(&self) -> StoreFuture<'_, Vec<RoleDefinition>> {
            async move {
                let rows: Vec<String> = sqlx::query_scalar(SELECT_ROLES)
                    .bind(false)
                    .fetch_all(&self.pool)
                    .await?;
                rows.iter().map(|t| role_from_json(t)).collect()
            }
            .boxed()
        }

        fn delete_role_definition<'a>(&'a self, id: &'a str) -> StoreFuture<'a, bool> {
            async move {
                let result = sqlx::query(DELETE_ROLE)
                    .bind(id.to_ascii_lowercase())
                    .bind(false)
                    .execute(&self.pool)
                    .await;
                match result {
                    Ok(done) => Ok(done.rows_affected() > 0),
                    Err(e) => Err(role_delete_error(e, id)),
                }
            }
            .boxed()
        }

        fn role_assignments<'a>(
            &'a self,
            cluster: Option<&'a str>,
        ) -> StoreFuture<'a, Vec<RoleAssignmentRecord>> {
            async move {
                let rows = match cluster {
                    Some(cluster) => {
                        sqlx::query(SELECT_CLUSTER_ASSIGNMENTS)
                            .bind(cluster)
                            .fetch_all(&self.pool)
                            .await?
                    }
                    None => {
                        sqlx::query(SELECT_ALL_ASSIGNMENTS)
                            .fetch_all(&self.pool)
                            .await?
                    }
                };
                rows.iter().map(assignment_from_row).collect()
            }
            .boxed()
        }

        fn deny_assignments<'a>(
            &'a self,
            cluster: Option<&'a str>,
        ) -> StoreFuture<'a, Vec<DenyAssignmentRecord>> {
            async move {
                let rows = match cluster {
                    Some(cluster) => {
                        sqlx::query(SELECT_CLUSTER_DENIES)
                            .bind(cluster)
                            .fetch_all(&self.pool)
                            .await?
                    }
                    None => sqlx::query(SELECT_ALL_DENIES).fetch_all(&self.pool).await?,
                };
                rows.iter().map(deny_from_row).collect()
            }
            .boxed()
        }

        fn set_directory_entry<'a>(&'a self, entry: &'a DirectoryEntry) -> StoreFuture<'a, ()> {
            async move {
                sqlx::query(UPSERT_DIRECTORY)
                    .bind(&entry.oid)
                    .bind(entry.tid.as_deref())
                    .bind(to_json(&entry.groups, "groups")?)
                    .bind(ts(entry.updated_at))
                    .execute(&self.pool)
                    .await?;
                Ok(())
            }
            .boxed()
        }

        fn directory_entry<'a>(&'a self, oid: &'a str) -> StoreFuture<'a, Option<DirectoryEntry>> {
            async move {
                let row = sqlx::query(SELECT_DIRECTORY)
                    .bind(oid)
                    .fetch_optional(&self.pool)
                    .await?;
                row.as_ref().map(directory_from_row).transpose()
            }
            .boxed()
        }

        fn delete_directory_entry<'a>(&'a self, oid: &'a str) -> StoreFuture<'a, bool> {
            async move {
                let done = sqlx::query(DELETE_DIRECTORY)
                    .bind(oid)
                    .execute(&self.pool)
                    .await?;
                Ok(done.rows_affected() > 0)
            }
            .boxed()
        }

        fn close(&self) -> StoreFuture<'_, ()> {
            async move {
                self.pool.close().await;
                Ok(())
            }
            .boxed()
        }
    };
}
pub(super) use pool_statements;

/// The [`Store`](super::Store) methods of the fleet (replica leases and the tunnels each replica holds),
/// expanded inside each backend's `impl Store` with `$now`, the SQL expression of the database's clock in Unix
/// milliseconds: lease times are the database's, never a replica's, so replicas need not agree on the time.
macro_rules! fleet_statements {
    ($now:literal) => {
        fn register_replica<'a>(&'a self, lease: &'a ReplicaLease) -> StoreFuture<'a, ()> {
            async move {
                // A restart with the same id holds none of the tunnels recorded before.
                sqlx::query("DELETE FROM relay_tunnels WHERE replica = $1")
                    .bind(&lease.id)
                    .execute(&self.pool)
                    .await?;
                sqlx::query(concat!(
                    "INSERT INTO relay_replicas (id, peer_address, started_at, lease_expires, draining) \
                     VALUES ($1, $2, ",
                    $now,
                    ", ",
                    $now,
                    " + $3, $4) ON CONFLICT (id) DO UPDATE SET peer_address = excluded.peer_address, \
                     started_at = excluded.started_at, lease_expires = excluded.lease_expires, \
                     draining = excluded.draining"
                ))
                .bind(&lease.id)
                .bind(lease.peer_address.as_deref())
                .bind(millis(lease.ttl))
                .bind(lease.draining)
                .execute(&self.pool)
                .await?;
                Ok(())
            }
            .boxed()
        }

        fn renew_lease<'a>(&'a self, lease: &'a ReplicaLease) -> StoreFuture<'a, bool> {
            async move {
                let done = sqlx::query(concat!(
                    "UPDATE relay_replicas SET lease_expires = ",
                    $now,
                    " + $1, draining = $2 WHERE id = $3"
                ))
                .bind(millis(lease.ttl))
                .bind(lease.draining)
                .bind(&lease.id)
                .execute(&self.pool)
                .await?;
                Ok(done.rows_affected() == 1)
            }
            .boxed()
        }

        fn remove_replica<'a>(&'a self, id: &'a str) -> StoreFuture<'a, ()> {
            async move {
                sqlx::query("DELETE FROM relay_replicas WHERE id = $1")
                    .bind(id)
                    .execute(&self.pool)
                    .await?;
                Ok(())
            }
            .boxed()
        }

        fn reap_replicas(&self, expired_for: std::time::Duration) -> StoreFuture<'_, u64> {
            async move {
                let done = sqlx::query(concat!(
                    "DELETE FROM relay_replicas WHERE lease_expires < ",
                    $now,
                    " - $1"
                ))
                .bind(millis(expired_for))
                .execute(&self.pool)
                .await?;
                Ok(done.rows_affected())
            }
            .boxed()
        }

        fn live_replicas(&self) -> StoreFuture<'_, Vec<ReplicaRecord>> {
            async move {
                let rows = sqlx::query(concat!(
                    "SELECT id, peer_address, started_at, lease_expires, draining FROM relay_replicas \
                     WHERE lease_expires > ",
                    $now,
                    " ORDER BY id"
                ))
                .fetch_all(&self.pool)
                .await?;
                rows.iter().map(replica_from_row).collect()
            }
            .boxed()
        }

        fn put_tunnel<'a>(&'a self, tunnel: &'a TunnelRecord) -> StoreFuture<'a, ()> {
            async move {
                sqlx::query(PUT_TUNNEL)
                    .bind(&tunnel.replica)
                    .bind(version_to_db(tunnel.tunnel_id))
                    .bind(&tunnel.cluster)
                    .bind(&tunnel.agent_instance)
                    .bind(i64::from(tunnel.agent_tunnels))
                    .bind(&tunnel.transport)
                    .bind(&tunnel.agent_address)
                    .bind(ts(tunnel.connected_since))
                    .bind(tunnel.usable)
                    .execute(&self.pool)
                    .await
                    .map_err(|e| tunnel_put_error(e, tunnel))?;
                Ok(())
            }
            .boxed()
        }

        fn remove_tunnel<'a>(&'a self, replica: &'a str, tunnel_id: u64) -> StoreFuture<'a, ()> {
            async move {
                sqlx::query("DELETE FROM relay_tunnels WHERE replica = $1 AND tunnel_id = $2")
                    .bind(replica)
                    .bind(version_to_db(tunnel_id))
                    .execute(&self.pool)
                    .await?;
                Ok(())
            }
            .boxed()
        }

        fn tunnel_routes<'a>(
            &'a self,
            cluster: Option<&'a str>,
        ) -> StoreFuture<'a, Vec<TunnelRoute>> {
            async move {
                let rows = match cluster {
                    Some(cluster) => {
                        sqlx::query(concat!(
                            "SELECT ",
                            "t.replica, t.tunnel_id, t.cluster, t.agent_instance, t.agent_tunnels, t.transport, \
                             t.agent_address, t.connected_since, t.usable, r.peer_address, r.draining",
                            " FROM relay_tunnels t JOIN relay_replicas r ON r.id = t.replica \
                             WHERE t.cluster = $1 AND r.lease_expires > ",
                            $now,
                            " ORDER BY t.cluster, t.replica, t.tunnel_id"
                        ))
                        .bind(cluster)
                        .fetch_all(&self.pool)
                        .await?
                    }
                    None => {
                        sqlx::query(concat!(
                            "SELECT ",
                            "t.replica, t.tunnel_id, t.cluster, t.agent_instance, t.agent_tunnels, t.transport, \
                             t.agent_address, t.connected_since, t.usable, r.peer_address, r.draining",
                            " FROM relay_tunnels t JOIN relay_replicas r ON r.id = t.replica \
                             WHERE r.lease_expires > ",
                            $now,
                            " ORDER BY t.cluster, t.replica, t.tunnel_id"
                        ))
                        .fetch_all(&self.pool)
                        .await?
                    }
                };
                rows.iter().map(route_from_row).collect()
            }
            .boxed()
        }
    };
}
pub(super) use fleet_statements;

/// The inserts a write transaction makes, the same for both backends on their own connection type `$conn`:
/// the change log entry and the rows of clusters, custom roles and role/deny assignments, with constraint
/// violations mapped to [`StoreError`]s.
macro_rules! connection_statements {
    ($conn:ty) => {
        /// Appends `kind` for `cluster` to the change log; the sequence number it took.
        async fn append_change(
            conn: &mut $conn,
            cluster: &str,
            kind: ChangeKind,
            at: OffsetDateTime,
        ) -> Result<i64, StoreError> {
            let seq: i64 = sqlx::query_scalar(NEXT_CHANGE_SEQ)
                .fetch_one(&mut *conn)
                .await?;
            sqlx::query(INSERT_CHANGE)
                .bind(seq)
                .bind(cluster)
                .bind(kind.as_db())
                .bind(kind.guard_version().map(version_to_db))
                .bind(ts(at))
                .execute(&mut *conn)
                .await?;
            Ok(seq)
        }

        async fn insert_assignment(
            conn: &mut $conn,
            a: &RoleAssignmentRecord,
        ) -> Result<(), StoreError> {
            bind_assignment(sqlx::query(INSERT_ASSIGNMENT), a)
                .execute(&mut *conn)
                .await
                .map_err(|e| assignment_insert_error(e, a))?;
            Ok(())
        }

        async fn insert_deny(conn: &mut $conn, d: &DenyAssignmentRecord) -> Result<(), StoreError> {
            bind_deny(sqlx::query(INSERT_DENY), d)?
                .execute(&mut *conn)
                .await
                .map_err(|e| deny_insert_error(e, d))?;
            Ok(())
        }

        async fn insert_role(
            conn: &mut $conn,
            role: &RoleDefinition,
            at: OffsetDateTime,
            if_absent: bool,
        ) -> Result<(), StoreError> {
            let sql = if if_absent {
                INSERT_ROLE_IF_ABSENT
            } else {
                INSERT_ROLE
            };
            bind_role(sqlx::query(sql), role, at)?
                .execute(&mut *conn)
                .await
                .map_err(|e| role_insert_error(e, role))?;
            Ok(())
        }

        /// Inserts a new cluster's row; [`StoreError::AlreadyExists`] if the name is taken.
        async fn insert_cluster(conn: &mut $conn, new: &NewCluster) -> Result<(), StoreError> {
            bind_cluster(sqlx::query(INSERT_CLUSTER), new)?
                .execute(&mut *conn)
                .await
                .map_err(|e| cluster_insert_error(e, new))?;
            Ok(())
        }

        /// Raises `cluster`'s snapshot version inside a write transaction; `None` for an unknown cluster.
        /// How this serializes concurrent guard changes is the backend's (see where it expands the macro).
        async fn bump_guard_version(
            conn: &mut $conn,
            cluster: &str,
        ) -> Result<Option<u64>, StoreError> {
            let floor = version_to_db(next_guard_version(0, OffsetDateTime::now_utc()));
            let version: Option<i64> = sqlx::query_scalar(BUMP_GUARD_VERSION)
                .bind(floor)
                .bind(floor)
                .bind(cluster)
                .fetch_optional(&mut *conn)
                .await?;
            version.map(version_from_db).transpose()
        }

        /// The guard snapshot of `cluster` (`None` for an unknown cluster), read inside the caller's transaction.
        async fn read_guard_state(
            conn: &mut $conn,
            cluster: &str,
        ) -> Result<Option<GuardState>, StoreError> {
            let version: Option<i64> = sqlx::query_scalar(SELECT_GUARD_VERSION)
                .bind(cluster)
                .fetch_optional(&mut *conn)
                .await?;
            let Some(version) = version else {
                return Ok(None);
            };
            let assignments = sqlx::query(SELECT_CLUSTER_ASSIGNMENTS)
                .bind(cluster)
                .fetch_all(&mut *conn)
                .await?;
            let denies = sqlx::query(SELECT_CLUSTER_DENIES)
                .bind(cluster)
                .fetch_all(&mut *conn)
                .await?;
            let roles: Vec<String> = sqlx::query_scalar(SELECT_GUARD_ROLES)
                .bind(false)
                .bind(cluster)
                .fetch_all(&mut *conn)
                .await?;
            Ok(Some(guard_state(version, &roles, &assignments, &denies)?))
        }

        /// The change log after `after` (at most `limit` entries), read inside the caller's transaction.
        async fn read_changes(
            conn: &mut $conn,
            after: u64,
            limit: u32,
        ) -> Result<ChangePage, StoreError> {
            let log_head: (i64, i64) = sqlx::query_as(SELECT_LOG_HEAD)
                .fetch_one(&mut *conn)
                .await?;
            let head = match log_position(after, log_head)? {
                Ok(head) => head,
                Err(reset) => return Ok(reset),
            };
            let rows = sqlx::query(SELECT_CHANGES)
                .bind(version_to_db(after))
                .bind(i64::from(limit))
                .fetch_all(&mut *conn)
                .await?;
            change_page(&rows, head)
        }

        /// Removes the change log entries older than `before` inside the caller's write transaction; how many.
        async fn prune_log(conn: &mut $conn, before: OffsetDateTime) -> Result<u64, StoreError> {
            let through: Option<i64> = sqlx::query_scalar(MAX_OLD_SEQ)
                .bind(ts(before))
                .fetch_one(&mut *conn)
                .await?;
            let Some(through) = through else {
                return Ok(0);
            };
            // Entries are appended in time order per replica, but clocks differ: remove everything up to the
            // newest old entry, so the log stays a suffix and `pruned_through` stays exact.
            let done = sqlx::query(DELETE_CHANGES_THROUGH)
                .bind(through)
                .execute(&mut *conn)
                .await?;
            sqlx::query(SET_PRUNED_THROUGH)
                .bind(through)
                .bind(through)
                .execute(&mut *conn)
                .await?;
            Ok(done.rows_affected())
        }
        /// Inserts `new` with its custom roles and assignments and logs its creation, inside the caller's write
        /// transaction (`record_change` is the backend's).
        async fn write_new_cluster(
            conn: &mut $conn,
            new: &NewCluster,
            roles: &[RoleDefinition],
            assignments: &[RoleAssignmentRecord],
            denies: &[DenyAssignmentRecord],
        ) -> Result<(), StoreError> {
            insert_cluster(&mut *conn, new).await?;
            for role in roles {
                insert_role(&mut *conn, role, new.created_at, true).await?;
            }
            for a in assignments {
                insert_assignment(&mut *conn, a).await?;
            }
            for d in denies {
                insert_deny(&mut *conn, d).await?;
            }
            record_change(
                &mut *conn,
                &new.name,
                ChangeKind::Created,
                OffsetDateTime::now_utc(),
            )
            .await?;
            Ok(())
        }

        /// A renewal with its change log entry, inside the caller's write transaction (`record_change` is the
        /// backend's); true when the presented certificate was current and is now replaced.
        async fn write_renewal(
            conn: &mut $conn,
            name: &str,
            presented: &str,
            identity: &NewIdentity,
        ) -> Result<bool, StoreError> {
            let done = sqlx::query(RENEW_IDENTITY)
                .bind(presented)
                .bind(&identity.fingerprint)
                .bind(ts(identity.not_after))
                .bind(name)
                .bind(presented)
                .execute(&mut *conn)
                .await?;
            if done.rows_affected() != 1 {
                return Ok(false);
            }
            record_change(
                &mut *conn,
                name,
                ChangeKind::Identity,
                OffsetDateTime::now_utc(),
            )
            .await?;
            Ok(true)
        }

        /// Raises the cluster's snapshot version, inserts `a` and logs the change, inside the caller's write
        /// transaction; the new version.
        async fn add_role_assignment(
            conn: &mut $conn,
            a: &RoleAssignmentRecord,
        ) -> Result<u64, StoreError> {
            let version = bump_guard_version(&mut *conn, &a.cluster)
                .await?
                .ok_or_else(|| cluster_not_found(&a.cluster))?;
            insert_assignment(&mut *conn, a).await?;
            let now = OffsetDateTime::now_utc();
            record_change(&mut *conn, &a.cluster, ChangeKind::Guard(version), now).await?;
            Ok(version)
        }

        /// [`add_role_assignment`] for a deny assignment.
        async fn add_deny_assignment(
            conn: &mut $conn,
            d: &DenyAssignmentRecord,
        ) -> Result<u64, StoreError> {
            let version = bump_guard_version(&mut *conn, &d.cluster)
                .await?
                .ok_or_else(|| cluster_not_found(&d.cluster))?;
            insert_deny(&mut *conn, d).await?;
            let now = OffsetDateTime::now_utc();
            record_change(&mut *conn, &d.cluster, ChangeKind::Guard(version), now).await?;
            Ok(version)
        }
    };
}
pub(super) use connection_statements;

/// Registers a built-in role once (binds: id, id key, name key, builtin).
pub(super) const INSERT_BUILTIN_ROLE: &str = "INSERT INTO role_definitions (id, id_key, name_key, builtin, definition, created_at) \
     VALUES ($1, $2, $3, $4, NULL, 0) ON CONFLICT DO NOTHING";

/// One cluster of an activity batch; COALESCE keeps what the batch does not carry, CASE keeps last_seen
/// monotonic (binds: seen, seen, health, agent version, name).
pub(super) const RECORD_ACTIVITY: &str = "UPDATE clusters SET \
     last_seen = CASE WHEN last_seen IS NULL OR last_seen < $1 THEN $2 ELSE last_seen END, \
     health = COALESCE($3, health), agent_version = COALESCE($4, agent_version) \
     WHERE name = $5";

/// Takes the next change log sequence number.
pub(super) const NEXT_CHANGE_SEQ: &str =
    "UPDATE change_log_head SET seq = seq + 1 WHERE id = 1 RETURNING seq";

/// Appends to the change log (binds: seq, cluster, kind, guard version, at).
pub(super) const INSERT_CHANGE: &str = "INSERT INTO cluster_changes (seq, cluster, kind, guard_version, changed_at) \
     VALUES ($1, $2, $3, $4, $5)";

/// Raises a cluster's snapshot version to at least a floor (binds: floor, floor, cluster).
pub(super) const BUMP_GUARD_VERSION: &str = "UPDATE clusters SET guard_version = \
     CASE WHEN guard_version + 1 > $1 THEN guard_version + 1 ELSE $2 END \
     WHERE name = $3 RETURNING guard_version";

/// Inserts a role assignment (binds in [`RoleAssignmentRecord`] field order).
pub(super) const INSERT_ASSIGNMENT: &str = "INSERT INTO role_assignments (id, role_id, principal_id, cluster, namespace, created_at) \
     VALUES ($1, $2, $3, $4, $5, $6)";

/// Inserts a deny assignment (binds in [`DenyAssignmentRecord`] field order).
pub(super) const INSERT_DENY: &str = "INSERT INTO deny_assignments (id, name, data_actions, not_data_actions, principals, \
     exclude_principals, cluster, namespace, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)";

/// Inserts a custom role definition (binds: id, id key, name key, builtin, definition, created).
pub(super) const INSERT_ROLE: &str = "INSERT INTO role_definitions (id, id_key, name_key, builtin, definition, created_at) \
     VALUES ($1, $2, $3, $4, $5, $6)";

/// [`INSERT_ROLE`], keeping an existing role of the same id or name.
pub(super) const INSERT_ROLE_IF_ABSENT: &str = "INSERT INTO role_definitions (id, id_key, name_key, builtin, definition, created_at) \
     VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING";

/// Inserts a new cluster (binds: name, tags, created, token hash, used, guard version).
pub(super) const INSERT_CLUSTER: &str = "INSERT INTO clusters (name, tags, created_at, onboarding_token_hash, onboarding_used, \
     guard_version) VALUES ($1, $2, $3, $4, $5, $6)";

/// One cluster by name.
pub(super) const SELECT_CLUSTER: &str = concat!(
    "SELECT ",
    cluster_columns!(),
    " FROM clusters WHERE name = $1"
);

/// All clusters by name.
pub(super) const LIST_CLUSTERS: &str = concat!(
    "SELECT ",
    cluster_columns!(),
    " FROM clusters ORDER BY name"
);

/// Deletes a cluster (its assignments cascade).
pub(super) const DELETE_CLUSTER: &str = "DELETE FROM clusters WHERE name = $1";

/// A cluster's onboarding secrets, read by [`secrets_from_row`].
pub(super) const SELECT_SECRETS: &str =
    "SELECT onboarding_token_hash, onboarding_used FROM clusters WHERE name = $1";

/// One conditional UPDATE: two concurrent redemptions cannot both see the token unused (binds: true,
/// fingerprint, not after, at, name, token hash, false).
pub(super) const REDEEM_TOKEN: &str = "UPDATE clusters SET onboarding_used = $1, identity_fingerprint = $2, identity_not_after = $3, \
     previous_fingerprint = NULL, onboarded_at = $4 \
     WHERE name = $5 AND onboarding_token_hash = $6 AND onboarding_used = $7";

/// A renewal: only the current certificate may renew (binds: presented, fingerprint, not after, name,
/// presented).
pub(super) const RENEW_IDENTITY: &str = "UPDATE clusters SET previous_fingerprint = $1, identity_fingerprint = $2, identity_not_after = $3 \
     WHERE name = $4 AND identity_fingerprint = $5";

/// An agent connected (binds: at, at, agent version, name).
pub(super) const RECORD_CONNECTED: &str =
    "UPDATE clusters SET connected_since = $1, last_seen = $2, agent_version = $3 WHERE name = $4";

/// An agent's metadata (binds: metadata, agent version, name).
pub(super) const RECORD_METADATA: &str =
    "UPDATE clusters SET metadata = $1, agent_version = $2 WHERE name = $3";

/// An agent disconnected.
pub(super) const RECORD_DISCONNECTED: &str =
    "UPDATE clusters SET connected_since = NULL WHERE name = $1";

/// The custom role definitions (bind: false).
pub(super) const SELECT_ROLES: &str =
    "SELECT definition FROM role_definitions WHERE builtin = $1 ORDER BY id_key";

/// Deletes a custom role definition (binds: id key, false).
pub(super) const DELETE_ROLE: &str =
    "DELETE FROM role_definitions WHERE id_key = $1 AND builtin = $2";

/// The role assignments of one cluster.
pub(super) const SELECT_CLUSTER_ASSIGNMENTS: &str = concat!(
    "SELECT ",
    assignment_columns!(),
    " FROM role_assignments WHERE cluster = $1 ORDER BY id"
);

/// All role assignments.
pub(super) const SELECT_ALL_ASSIGNMENTS: &str = concat!(
    "SELECT ",
    assignment_columns!(),
    " FROM role_assignments ORDER BY cluster, id"
);

/// The deny assignments of one cluster.
pub(super) const SELECT_CLUSTER_DENIES: &str =
    "SELECT * FROM deny_assignments WHERE cluster = $1 ORDER BY id";

/// All deny assignments.
pub(super) const SELECT_ALL_DENIES: &str = "SELECT * FROM deny_assignments ORDER BY cluster, id";

/// A cluster's snapshot version.
pub(super) const SELECT_GUARD_VERSION: &str = "SELECT guard_version FROM clusters WHERE name = $1";

/// The custom roles a cluster's assignments use (binds: false, cluster).
pub(super) const SELECT_GUARD_ROLES: &str = "SELECT definition FROM role_definitions WHERE builtin = $1 AND id IN \
     (SELECT role_id FROM role_assignments WHERE cluster = $2) ORDER BY id_key";

/// Sets a directory entry (binds: oid, tid, groups, updated).
pub(super) const UPSERT_DIRECTORY: &str = "INSERT INTO directory_users (oid, tid, groups, updated_at) VALUES ($1, $2, $3, $4) \
     ON CONFLICT (oid) DO UPDATE SET tid = excluded.tid, groups = excluded.groups, \
     updated_at = excluded.updated_at";

/// One directory entry, read by [`directory_from_row`].
pub(super) const SELECT_DIRECTORY: &str =
    "SELECT oid, tid, groups, updated_at FROM directory_users WHERE oid = $1";

/// Deletes a directory entry.
pub(super) const DELETE_DIRECTORY: &str = "DELETE FROM directory_users WHERE oid = $1";

/// Replaces a cluster's tags (binds: tags, name).
pub(super) const SET_TAGS: &str = "UPDATE clusters SET tags = $1 WHERE name = $2";

/// The change log's head and pruning mark.
pub(super) const SELECT_LOG_HEAD: &str =
    "SELECT seq, pruned_through FROM change_log_head WHERE id = 1";

/// A page of the change log, read by [`change_from_row`] (binds: after, limit).
pub(super) const SELECT_CHANGES: &str = "SELECT seq, cluster, kind, guard_version, changed_at FROM cluster_changes \
     WHERE seq > $1 ORDER BY seq LIMIT $2";

/// The newest change older than a time.
pub(super) const MAX_OLD_SEQ: &str = "SELECT MAX(seq) FROM cluster_changes WHERE changed_at < $1";

/// Removes the log up to a sequence number.
pub(super) const DELETE_CHANGES_THROUGH: &str = "DELETE FROM cluster_changes WHERE seq <= $1";

/// Raises the pruning mark (binds: through, through).
pub(super) const SET_PRUNED_THROUGH: &str =
    "UPDATE change_log_head SET pruned_through = $1 WHERE id = 1 AND pruned_through < $2";

/// Records a tunnel or updates what can change about it (binds: replica, tunnel id, cluster, instance,
/// agent tunnels, transport, agent address, since, usable).
pub(super) const PUT_TUNNEL: &str = "INSERT INTO relay_tunnels (replica, tunnel_id, cluster, agent_instance, agent_tunnels, \
     transport, agent_address, connected_since, usable) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
     ON CONFLICT (replica, tunnel_id) DO UPDATE SET agent_instance = excluded.agent_instance, \
     agent_tunnels = excluded.agent_tunnels, usable = excluded.usable";

/// The typed column reads the decoders need, for the rows of any database whose driver decodes text,
/// integers and booleans (both of ours).
pub(super) trait Columns {
    /// A non-null text column.
    fn text(&self, column: &str) -> Result<String, StoreError>;
    /// A nullable text column.
    fn opt_text(&self, column: &str) -> Result<Option<String>, StoreError>;
    /// A non-null integer column.
    fn int(&self, column: &str) -> Result<i64, StoreError>;
    /// A nullable integer column.
    fn opt_int(&self, column: &str) -> Result<Option<i64>, StoreError>;
    /// A boolean column.
    fn flag(&self, column: &str) -> Result<bool, StoreError>;
}

impl<R> Columns for R
where
    R: Row,
    for<'c> &'c str: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database>,
    String: Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database>,
    i64: Type<R::Database>,
    for<'r> bool: Decode<'r, R::Database>,
    bool: Type<R::Database>,
{
    fn text(&self, column: &str) -> Result<String, StoreError> {
        Ok(self.try_get(column)?)
    }
    fn opt_text(&self, column: &str) -> Result<Option<String>, StoreError> {
        Ok(self.try_get(column)?)
    }
    fn int(&self, column: &str) -> Result<i64, StoreError> {
        Ok(self.try_get(column)?)
    }
    fn opt_int(&self, column: &str) -> Result<Option<i64>, StoreError> {
        Ok(self.try_get(column)?)
    }
    fn flag(&self, column: &str) -> Result<bool, StoreError> {
        Ok(self.try_get(column)?)
    }
}

/// The typed binds the shared statements need, for the queries of any database whose driver encodes text,
/// integers and booleans (both of ours).
pub(super) trait Binds: Sized {
    /// Binds a text value.
    fn text(self, value: &str) -> Self;
    /// Binds a nullable text value.
    fn opt_text(self, value: Option<&str>) -> Self;
    /// Binds an integer.
    fn int(self, value: i64) -> Self;
    /// Binds a boolean.
    fn flag(self, value: bool) -> Self;
}

impl<DB> Binds for Query<'_, DB, <DB as Database>::Arguments>
where
    DB: Database,
    for<'t> &'t str: Encode<'t, DB> + Type<DB>,
    for<'t> Option<&'t str>: Encode<'t, DB> + Type<DB>,
    for<'t> i64: Encode<'t, DB>,
    i64: Type<DB>,
    for<'t> bool: Encode<'t, DB>,
    bool: Type<DB>,
{
    fn text(self, value: &str) -> Self {
        self.bind(value)
    }
    fn opt_text(self, value: Option<&str>) -> Self {
        self.bind(value)
    }
    fn int(self, value: i64) -> Self {
        self.bind(value)
    }
    fn flag(self, value: bool) -> Self {
        self.bind(value)
    }
}

/// Binds [`INSERT_ASSIGNMENT`]'s parameters.
pub(super) fn bind_assignment<Q: Binds>(q: Q, a: &RoleAssignmentRecord) -> Q {
    q.text(&a.id)
        .text(&a.role_id)
        .text(&a.principal_id)
        .text(&a.cluster)
        .text(namespace_key(&a.namespace))
        .int(ts(a.created_at))
}

/// Binds [`INSERT_DENY`]'s parameters.
pub(super) fn bind_deny<Q: Binds>(q: Q, d: &DenyAssignmentRecord) -> Result<Q, StoreError> {
    Ok(q.text(&d.id)
        .text(&d.name)
        .text(&to_json(&d.data_actions, "dataActions")?)
        .text(&to_json(&d.not_data_actions, "notDataActions")?)
        .text(&to_json(&d.principals, "principals")?)
        .text(&to_json(&d.exclude_principals, "excludePrincipals")?)
        .text(&d.cluster)
        .text(namespace_key(&d.namespace))
        .int(ts(d.created_at)))
}

/// Binds [`INSERT_ROLE`]'s (or [`INSERT_ROLE_IF_ABSENT`]'s) parameters for a custom role.
pub(super) fn bind_role<Q: Binds>(
    q: Q,
    role: &RoleDefinition,
    at: OffsetDateTime,
) -> Result<Q, StoreError> {
    Ok(q.text(&role.id)
        .text(&role.id.to_ascii_lowercase())
        .text(&role.name.to_ascii_lowercase())
        .flag(false)
        .text(&to_json(role, "role definition")?)
        .int(ts(at)))
}

/// Binds [`INSERT_CLUSTER`]'s parameters.
pub(super) fn bind_cluster<Q: Binds>(q: Q, new: &NewCluster) -> Result<Q, StoreError> {
    Ok(q.text(&new.name)
        .text(&to_json(&new.tags, "tags")?)
        .int(ts(new.created_at))
        .text(&new.onboarding_token_hash.to_hex())
        .flag(false)
        .int(version_to_db(next_guard_version(0, new.created_at))))
}

/// Binds [`RECORD_ACTIVITY`]'s parameters for one cluster of a batch.
pub(super) fn bind_activity<Q: Binds>(q: Q, a: &Activity) -> Result<Q, StoreError> {
    let health = a
        .health
        .as_ref()
        .map(|h| to_json(h, "health"))
        .transpose()?;
    Ok(q.int(ts(a.seen_at))
        .int(ts(a.seen_at))
        .opt_text(health.as_deref())
        .opt_text(a.agent_version.as_deref())
        .text(&a.name))
}

pub(super) fn is_unique_violation(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .is_some_and(|d| d.is_unique_violation())
}

pub(super) fn is_foreign_key_violation(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .is_some_and(|d| matches!(d.kind(), ErrorKind::ForeignKeyViolation))
}

pub(super) fn version_from_db(v: i64) -> Result<u64, StoreError> {
    u64::try_from(v).map_err(|_| StoreError::Corrupt(format!("guard version {v}")))
}

pub(super) fn version_to_db(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// `''` stands for the whole cluster in the namespace columns.
pub(super) fn namespace_key(namespace: &Option<String>) -> &str {
    namespace.as_deref().unwrap_or("")
}

fn namespace_from_key(key: String) -> Option<String> {
    (!key.is_empty()).then_some(key)
}

pub(super) fn ts(t: OffsetDateTime) -> i64 {
    t.unix_timestamp()
}

fn from_ts(secs: i64) -> Result<OffsetDateTime, StoreError> {
    OffsetDateTime::from_unix_timestamp(secs)
        .map_err(|e| StoreError::Corrupt(format!("timestamp {secs}: {e}")))
}

fn opt_ts(secs: Option<i64>) -> Result<Option<OffsetDateTime>, StoreError> {
    secs.map(from_ts).transpose()
}

pub(super) fn to_json<T: serde::Serialize>(value: &T, what: &str) -> Result<String, StoreError> {
    serde_json::to_string(value).map_err(|e| StoreError::Corrupt(format!("{what}: {e}")))
}

pub(super) fn role_from_json(text: &str) -> Result<RoleDefinition, StoreError> {
    serde_json::from_str(text).map_err(|e| StoreError::Corrupt(format!("role definition: {e}")))
}

fn json_column<T: serde::de::DeserializeOwned>(
    row: &impl Columns,
    column: &str,
) -> Result<Option<T>, StoreError> {
    let text = row.opt_text(column)?;
    text.map(|t| {
        serde_json::from_str(&t).map_err(|e| StoreError::Corrupt(format!("{column}: {e}")))
    })
    .transpose()
}

fn string_list(row: &impl Columns, column: &str) -> Result<Vec<String>, StoreError> {
    Ok(json_column(row, column)?.unwrap_or_default())
}

/// A row of [`SELECT_CLUSTER`] / [`LIST_CLUSTERS`].
pub(super) fn cluster_from_row(row: &impl Columns) -> Result<ClusterRecord, StoreError> {
    let tags = row.text("tags")?;
    let tags: BTreeMap<String, String> =
        serde_json::from_str(&tags).map_err(|e| StoreError::Corrupt(format!("tags: {e}")))?;
    let fingerprint = row.opt_text("identity_fingerprint")?;
    let not_after = opt_ts(row.opt_int("identity_not_after")?)?;
    let identity = match (fingerprint, not_after) {
        (Some(fingerprint), Some(not_after)) => Some(ClusterIdentity {
            fingerprint,
            not_after,
            previous_fingerprint: row.opt_text("previous_fingerprint")?,
        }),
        _ => None,
    };
    Ok(ClusterRecord {
        name: row.text("name")?,
        tags,
        created_at: from_ts(row.int("created_at")?)?,
        onboarded: row.flag("onboarding_used")?,
        connected_since: opt_ts(row.opt_int("connected_since")?)?,
        last_seen: opt_ts(row.opt_int("last_seen")?)?,
        agent_version: row.opt_text("agent_version")?,
        identity,
        metadata: json_column(row, "metadata")?,
        health: json_column(row, "health")?,
    })
}

/// The record of a cluster just registered.
pub(super) fn new_record(new: &NewCluster) -> Result<ClusterRecord, StoreError> {
    Ok(ClusterRecord {
        name: new.name.clone(),
        tags: new.tags.clone(),
        created_at: from_ts(ts(new.created_at))?,
        onboarded: false,
        connected_since: None,
        last_seen: None,
        agent_version: None,
        identity: None,
        metadata: None,
        health: None,
    })
}

/// A row of [`SELECT_SECRETS`].
pub(super) fn secrets_from_row(row: &impl Columns) -> Result<ClusterSecrets, StoreError> {
    let token = row.opt_text("onboarding_token_hash")?;
    Ok(ClusterSecrets {
        onboarding_token_hash: token.as_deref().map(TokenHash::from_hex).transpose()?,
        onboarding_used: row.flag("onboarding_used")?,
    })
}

/// A row of the role assignment selects.
pub(super) fn assignment_from_row(row: &impl Columns) -> Result<RoleAssignmentRecord, StoreError> {
    Ok(RoleAssignmentRecord {
        id: row.text("id")?,
        role_id: row.text("role_id")?,
        principal_id: row.text("principal_id")?,
        cluster: row.text("cluster")?,
        namespace: namespace_from_key(row.text("namespace")?),
        created_at: from_ts(row.int("created_at")?)?,
    })
}

/// A row of the deny assignment selects.
pub(super) fn deny_from_row(row: &impl Columns) -> Result<DenyAssignmentRecord, StoreError> {
    Ok(DenyAssignmentRecord {
        id: row.text("id")?,
        name: row.text("name")?,
        data_actions: string_list(row, "data_actions")?,
        not_data_actions: string_list(row, "not_data_actions")?,
        principals: string_list(row, "principals")?,
        exclude_principals: string_list(row, "exclude_principals")?,
        cluster: row.text("cluster")?,
        namespace: namespace_from_key(row.text("namespace")?),
        created_at: from_ts(row.int("created_at")?)?,
    })
}

/// A row of [`SELECT_DIRECTORY`].
pub(super) fn directory_from_row(row: &impl Columns) -> Result<DirectoryEntry, StoreError> {
    Ok(DirectoryEntry {
        oid: row.text("oid")?,
        tid: row.opt_text("tid")?,
        groups: string_list(row, "groups")?,
        updated_at: from_ts(row.int("updated_at")?)?,
    })
}

/// A row of [`SELECT_CHANGES`].
pub(super) fn change_from_row(row: &impl Columns) -> Result<ClusterChange, StoreError> {
    let kind = row.text("kind")?;
    let version = row.opt_int("guard_version")?;
    Ok(ClusterChange {
        seq: version_from_db(row.int("seq")?)?,
        cluster: row.text("cluster")?,
        kind: ChangeKind::from_db(&kind, version.map(version_from_db).transpose()?)?,
        at: from_ts(row.int("changed_at")?)?,
    })
}

/// A duration in whole milliseconds, for lease arithmetic in SQL.
pub(super) fn millis(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn from_millis(ms: i64) -> Result<OffsetDateTime, StoreError> {
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .map_err(|e| StoreError::Corrupt(format!("timestamp {ms} ms: {e}")))
}

/// A row of the live replicas.
pub(super) fn replica_from_row(row: &impl Columns) -> Result<ReplicaRecord, StoreError> {
    Ok(ReplicaRecord {
        id: row.text("id")?,
        peer_address: row.opt_text("peer_address")?,
        started_at: from_millis(row.int("started_at")?)?,
        lease_expires: from_millis(row.int("lease_expires")?)?,
        draining: row.flag("draining")?,
    })
}

/// A row of the tunnel routes.
pub(super) fn route_from_row(row: &impl Columns) -> Result<TunnelRoute, StoreError> {
    let agent_tunnels = row.int("agent_tunnels")?;
    Ok(TunnelRoute {
        tunnel: TunnelRecord {
            replica: row.text("replica")?,
            tunnel_id: version_from_db(row.int("tunnel_id")?)?,
            cluster: row.text("cluster")?,
            agent_instance: row.text("agent_instance")?,
            agent_tunnels: u32::try_from(agent_tunnels)
                .map_err(|_| StoreError::Corrupt(format!("agent tunnels {agent_tunnels}")))?,
            transport: row.text("transport")?,
            agent_address: row.text("agent_address")?,
            connected_since: from_ts(row.int("connected_since")?)?,
            usable: row.flag("usable")?,
        },
        peer_address: row.opt_text("peer_address")?,
        replica_draining: row.flag("draining")?,
    })
}

/// What a failed [`PUT_TUNNEL`] means: a foreign key violation is a cluster (deleted) or a replica (reaped)
/// that is gone.
pub(super) fn tunnel_put_error(e: sqlx::Error, t: &TunnelRecord) -> StoreError {
    if is_foreign_key_violation(&e) {
        StoreError::NotFound(format!(
            "cluster {} or replica {} is gone",
            t.cluster, t.replica
        ))
    } else {
        e.into()
    }
}

/// A guard snapshot from the rows read in one transaction.
pub(super) fn guard_state<R: Columns>(
    version: i64,
    roles: &[String],
    assignments: &[R],
    denies: &[R],
) -> Result<GuardState, StoreError> {
    Ok(GuardState {
        version: version_from_db(version)?,
        roles: roles
            .iter()
            .map(|t| role_from_json(t))
            .collect::<Result<_, _>>()?,
        assignments: assignments
            .iter()
            .map(assignment_from_row)
            .collect::<Result<_, _>>()?,
        deny_assignments: denies.iter().map(deny_from_row).collect::<Result<_, _>>()?,
    })
}

/// Where a reader at `after` stands in the log (`head`, `pruned_through` read with [`SELECT_LOG_HEAD`]):
/// `Err` carries the reset page when `after` fell off the log or lies ahead of it, `Ok` the head to read up to.
pub(super) fn log_position(
    after: u64,
    (head, pruned_through): (i64, i64),
) -> Result<Result<u64, ChangePage>, StoreError> {
    let head = version_from_db(head)?;
    let pruned_through = version_from_db(pruned_through)?;
    if after < pruned_through || after > head {
        return Ok(Err(ChangePage {
            changes: Vec::new(),
            head,
            reset: true,
        }));
    }
    Ok(Ok(head))
}

/// A page of the log from the rows of [`SELECT_CHANGES`].
pub(super) fn change_page<R: Columns>(rows: &[R], head: u64) -> Result<ChangePage, StoreError> {
    Ok(ChangePage {
        changes: rows.iter().map(change_from_row).collect::<Result<_, _>>()?,
        head,
        reset: false,
    })
}

/// The error for a guard change on a cluster that does not exist.
pub(super) fn cluster_not_found(cluster: &str) -> StoreError {
    StoreError::NotFound(format!("clusters \"{cluster}\" not found"))
}

/// What a failed [`INSERT_CLUSTER`] means.
pub(super) fn cluster_insert_error(e: sqlx::Error, new: &NewCluster) -> StoreError {
    if is_unique_violation(&e) {
        StoreError::AlreadyExists(new.name.clone())
    } else {
        e.into()
    }
}

/// What a failed [`INSERT_ASSIGNMENT`] means.
pub(super) fn assignment_insert_error(e: sqlx::Error, a: &RoleAssignmentRecord) -> StoreError {
    if is_foreign_key_violation(&e) {
        // The cluster row is locked and known by now, so the failed reference is the role.
        StoreError::NotFound(format!("role definition {:?} not found", a.role_id))
    } else if is_unique_violation(&e) {
        StoreError::Conflict(format!(
            "principal {} already has role {} on cluster {}{}, or the id {} is taken",
            a.principal_id,
            a.role_id,
            a.cluster,
            a.namespace
                .as_deref()
                .map(|ns| format!(" in namespace {ns}"))
                .unwrap_or_default(),
            a.id
        ))
    } else {
        e.into()
    }
}

/// What a failed [`INSERT_DENY`] means.
pub(super) fn deny_insert_error(e: sqlx::Error, d: &DenyAssignmentRecord) -> StoreError {
    if is_unique_violation(&e) {
        StoreError::Conflict(format!("deny assignment id {} is taken", d.id))
    } else {
        e.into()
    }
}

/// What a failed [`INSERT_ROLE`] means.
pub(super) fn role_insert_error(e: sqlx::Error, role: &RoleDefinition) -> StoreError {
    if is_unique_violation(&e) {
        StoreError::Conflict(format!(
            "a role definition with id {:?} or name {:?} already exists",
            role.id, role.name
        ))
    } else {
        e.into()
    }
}

/// What a failed [`DELETE_ROLE`] means.
pub(super) fn role_delete_error(e: sqlx::Error, id: &str) -> StoreError {
    if is_foreign_key_violation(&e) {
        StoreError::Conflict(format!(
            "role definition {id:?} is assigned: delete its role assignments first"
        ))
    } else {
        e.into()
    }
}

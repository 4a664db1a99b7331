//! The default [`Store`]: SQLite through sqlx, WAL mode, embedded migrations.
//!
//! Queries are plain runtime SQL with `$n` placeholders, which PostgreSQL understands too (the PostgreSQL
//! store, `postgres.rs`, keeps the same statements wherever the dialects agree).
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
use sqlx::Row;
use sqlx::error::ErrorKind;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteRow, SqliteSynchronous,
};
use tether_auth::rbac::{RoleDefinition, builtin_roles};
use time::OffsetDateTime;
use tokio::sync::watch;

use super::{
    Activity, ChangeKind, ChangePage, ChangeSignals, ClusterChange, ClusterIdentity,
    ClusterMetadata, ClusterRecord, ClusterSecrets, DenyAssignmentRecord, DirectoryEntry,
    GuardState, NewCluster, NewIdentity, RoleAssignmentRecord, Store, StoreError, StoreFuture,
    TokenHash, next_guard_version,
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
            sqlx::query(
                "INSERT INTO role_definitions (id, id_key, name_key, builtin, definition, created_at) \
                 VALUES ($1, $2, $3, $4, NULL, 0) ON CONFLICT DO NOTHING",
            )
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
    let seq: i64 =
        sqlx::query_scalar("UPDATE change_log_head SET seq = seq + 1 WHERE id = 1 RETURNING seq")
            .fetch_one(&mut *conn)
            .await?;
    sqlx::query(
        "INSERT INTO cluster_changes (seq, cluster, kind, guard_version, changed_at) \
         VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(seq)
    .bind(cluster)
    .bind(kind.as_db())
    .bind(kind.guard_version().map(version_to_db))
    .bind(ts(at))
    .execute(&mut *conn)
    .await?;
    version_from_db(seq)
}

fn change_from_row(row: &SqliteRow) -> Result<ClusterChange, StoreError> {
    let kind: String = row.try_get("kind")?;
    let version: Option<i64> = row.try_get("guard_version")?;
    Ok(ClusterChange {
        seq: version_from_db(row.try_get("seq")?)?,
        cluster: row.try_get("cluster")?,
        kind: ChangeKind::from_db(&kind, version.map(version_from_db).transpose()?)?,
        at: from_ts(row.try_get("changed_at")?)?,
    })
}

fn is_unique_violation(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .is_some_and(|d| d.is_unique_violation())
}

fn is_foreign_key_violation(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .is_some_and(|d| matches!(d.kind(), ErrorKind::ForeignKeyViolation))
}

fn version_from_db(v: i64) -> Result<u64, StoreError> {
    u64::try_from(v).map_err(|_| StoreError::Corrupt(format!("guard version {v}")))
}

fn version_to_db(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// `''` stands for the whole cluster in the namespace columns.
fn namespace_key(namespace: &Option<String>) -> &str {
    namespace.as_deref().unwrap_or("")
}

fn namespace_from_key(key: String) -> Option<String> {
    (!key.is_empty()).then_some(key)
}

/// Raises `cluster`'s snapshot version inside a write transaction; `None` for an unknown cluster. Being the
/// first write of its transaction, it also takes the write lock before anything is read.
async fn bump_guard_version(
    conn: &mut SqliteConnection,
    cluster: &str,
) -> Result<Option<u64>, StoreError> {
    let floor = version_to_db(next_guard_version(0, OffsetDateTime::now_utc()));
    let version: Option<i64> = sqlx::query_scalar(
        "UPDATE clusters SET guard_version = \
         CASE WHEN guard_version + 1 > $1 THEN guard_version + 1 ELSE $2 END \
         WHERE name = $3 RETURNING guard_version",
    )
    .bind(floor)
    .bind(floor)
    .bind(cluster)
    .fetch_optional(&mut *conn)
    .await?;
    version.map(version_from_db).transpose()
}

fn role_from_json(text: &str) -> Result<RoleDefinition, StoreError> {
    serde_json::from_str(text).map_err(|e| StoreError::Corrupt(format!("role definition: {e}")))
}

fn assignment_from_row(row: &SqliteRow) -> Result<RoleAssignmentRecord, StoreError> {
    Ok(RoleAssignmentRecord {
        id: row.try_get("id")?,
        role_id: row.try_get("role_id")?,
        principal_id: row.try_get("principal_id")?,
        cluster: row.try_get("cluster")?,
        namespace: namespace_from_key(row.try_get("namespace")?),
        created_at: from_ts(row.try_get("created_at")?)?,
    })
}

fn string_list(row: &SqliteRow, column: &str) -> Result<Vec<String>, StoreError> {
    Ok(json_column(row, column)?.unwrap_or_default())
}

fn deny_from_row(row: &SqliteRow) -> Result<DenyAssignmentRecord, StoreError> {
    Ok(DenyAssignmentRecord {
        id: row.try_get("id")?,
        name: row.try_get("name")?,
        data_actions: string_list(row, "data_actions")?,
        not_data_actions: string_list(row, "not_data_actions")?,
        principals: string_list(row, "principals")?,
        exclude_principals: string_list(row, "exclude_principals")?,
        cluster: row.try_get("cluster")?,
        namespace: namespace_from_key(row.try_get("namespace")?),
        created_at: from_ts(row.try_get("created_at")?)?,
    })
}

/// The columns [`assignment_from_row`] reads.
macro_rules! assignment_columns {
    () => {
        "id, role_id, principal_id, cluster, namespace, created_at"
    };
}

async fn insert_assignment(
    conn: &mut SqliteConnection,
    a: &RoleAssignmentRecord,
) -> Result<(), StoreError> {
    let result = sqlx::query(
        "INSERT INTO role_assignments (id, role_id, principal_id, cluster, namespace, created_at) \
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(&a.id)
    .bind(&a.role_id)
    .bind(&a.principal_id)
    .bind(&a.cluster)
    .bind(namespace_key(&a.namespace))
    .bind(ts(a.created_at))
    .execute(&mut *conn)
    .await;
    match result {
        Ok(_) => Ok(()),
        // The cluster row is locked and known by now, so the failed reference is the role.
        Err(e) if is_foreign_key_violation(&e) => Err(StoreError::NotFound(format!(
            "role definition {:?} not found",
            a.role_id
        ))),
        Err(e) if is_unique_violation(&e) => Err(StoreError::Conflict(format!(
            "principal {} already has role {} on cluster {}{}, or the id {} is taken",
            a.principal_id,
            a.role_id,
            a.cluster,
            a.namespace
                .as_deref()
                .map(|ns| format!(" in namespace {ns}"))
                .unwrap_or_default(),
            a.id
        ))),
        Err(e) => Err(e.into()),
    }
}

async fn insert_deny(
    conn: &mut SqliteConnection,
    d: &DenyAssignmentRecord,
) -> Result<(), StoreError> {
    let result = sqlx::query(
        "INSERT INTO deny_assignments (id, name, data_actions, not_data_actions, principals, \
         exclude_principals, cluster, namespace, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
    )
    .bind(&d.id)
    .bind(&d.name)
    .bind(to_json(&d.data_actions, "dataActions")?)
    .bind(to_json(&d.not_data_actions, "notDataActions")?)
    .bind(to_json(&d.principals, "principals")?)
    .bind(to_json(&d.exclude_principals, "excludePrincipals")?)
    .bind(&d.cluster)
    .bind(namespace_key(&d.namespace))
    .bind(ts(d.created_at))
    .execute(&mut *conn)
    .await;
    match result {
        Ok(_) => Ok(()),
        Err(e) if is_unique_violation(&e) => Err(StoreError::Conflict(format!(
            "deny assignment id {} is taken",
            d.id
        ))),
        Err(e) => Err(e.into()),
    }
}

async fn insert_role(
    conn: &mut SqliteConnection,
    role: &RoleDefinition,
    at: OffsetDateTime,
    if_absent: bool,
) -> Result<(), StoreError> {
    let sql = if if_absent {
        "INSERT INTO role_definitions (id, id_key, name_key, builtin, definition, created_at) \
         VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING"
    } else {
        "INSERT INTO role_definitions (id, id_key, name_key, builtin, definition, created_at) \
         VALUES ($1, $2, $3, $4, $5, $6)"
    };
    let result = sqlx::query(sql)
        .bind(&role.id)
        .bind(role.id.to_ascii_lowercase())
        .bind(role.name.to_ascii_lowercase())
        .bind(false)
        .bind(to_json(role, "role definition")?)
        .bind(ts(at))
        .execute(&mut *conn)
        .await;
    match result {
        Ok(_) => Ok(()),
        Err(e) if is_unique_violation(&e) => Err(StoreError::Conflict(format!(
            "a role definition with id {:?} or name {:?} already exists",
            role.id, role.name
        ))),
        Err(e) => Err(e.into()),
    }
}

fn ts(t: OffsetDateTime) -> i64 {
    t.unix_timestamp()
}

fn from_ts(secs: i64) -> Result<OffsetDateTime, StoreError> {
    OffsetDateTime::from_unix_timestamp(secs)
        .map_err(|e| StoreError::Corrupt(format!("timestamp {secs}: {e}")))
}

fn opt_ts(secs: Option<i64>) -> Result<Option<OffsetDateTime>, StoreError> {
    secs.map(from_ts).transpose()
}

/// The columns [`cluster_from_row`] reads (a macro so that queries stay static strings).
macro_rules! cluster_columns {
    () => {
        "name, tags, created_at, onboarding_used, connected_since, last_seen, agent_version, \
         identity_fingerprint, identity_not_after, previous_fingerprint, metadata, health"
    };
}

fn json_column<T: serde::de::DeserializeOwned>(
    row: &SqliteRow,
    column: &str,
) -> Result<Option<T>, StoreError> {
    let text: Option<String> = row.try_get(column)?;
    text.map(|t| {
        serde_json::from_str(&t).map_err(|e| StoreError::Corrupt(format!("{column}: {e}")))
    })
    .transpose()
}

fn to_json<T: serde::Serialize>(value: &T, what: &str) -> Result<String, StoreError> {
    serde_json::to_string(value).map_err(|e| StoreError::Corrupt(format!("{what}: {e}")))
}

/// The record of a cluster just registered.
fn new_record(new: &NewCluster) -> Result<ClusterRecord, StoreError> {
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

/// Inserts a new cluster's row; [`StoreError::AlreadyExists`] if the name is taken.
async fn insert_cluster(conn: &mut SqliteConnection, new: &NewCluster) -> Result<(), StoreError> {
    let result = sqlx::query(
        "INSERT INTO clusters (name, tags, created_at, onboarding_token_hash, onboarding_used, \
         guard_version) VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(&new.name)
    .bind(to_json(&new.tags, "tags")?)
    .bind(ts(new.created_at))
    .bind(new.onboarding_token_hash.to_hex())
    .bind(false)
    .bind(version_to_db(next_guard_version(0, new.created_at)))
    .execute(&mut *conn)
    .await;
    match result {
        Ok(_) => Ok(()),
        Err(e) if is_unique_violation(&e) => Err(StoreError::AlreadyExists(new.name.clone())),
        Err(e) => Err(e.into()),
    }
}

fn cluster_from_row(row: &SqliteRow) -> Result<ClusterRecord, StoreError> {
    let tags: String = row.try_get("tags")?;
    let tags: BTreeMap<String, String> =
        serde_json::from_str(&tags).map_err(|e| StoreError::Corrupt(format!("tags: {e}")))?;
    let fingerprint: Option<String> = row.try_get("identity_fingerprint")?;
    let not_after = opt_ts(row.try_get("identity_not_after")?)?;
    let identity = match (fingerprint, not_after) {
        (Some(fingerprint), Some(not_after)) => Some(ClusterIdentity {
            fingerprint,
            not_after,
            previous_fingerprint: row.try_get("previous_fingerprint")?,
        }),
        _ => None,
    };
    Ok(ClusterRecord {
        name: row.try_get("name")?,
        tags,
        created_at: from_ts(row.try_get("created_at")?)?,
        onboarded: row.try_get("onboarding_used")?,
        connected_since: opt_ts(row.try_get("connected_since")?)?,
        last_seen: opt_ts(row.try_get("last_seen")?)?,
        agent_version: row.try_get("agent_version")?,
        identity,
        metadata: json_column(row, "metadata")?,
        health: json_column(row, "health")?,
    })
}

impl Store for SqliteStore {
    fn create_cluster<'a>(&'a self, new: &'a NewCluster) -> StoreFuture<'a, ClusterRecord> {
        async move {
            let mut tx = self.pool.begin_with(BEGIN_WRITE).await?;
            insert_cluster(&mut tx, new).await?;
            record_change(
                &mut tx,
                &new.name,
                ChangeKind::Created,
                OffsetDateTime::now_utc(),
            )
            .await?;
            tx.commit().await?;
            self.signal_change();
            new_record(new)
        }
        .boxed()
    }

    fn cluster<'a>(&'a self, name: &'a str) -> StoreFuture<'a, Option<ClusterRecord>> {
        async move {
            let row = sqlx::query(concat!(
                "SELECT ",
                cluster_columns!(),
                " FROM clusters WHERE name = $1"
            ))
            .bind(name)
            .fetch_optional(&self.pool)
            .await?;
            row.as_ref().map(cluster_from_row).transpose()
        }
        .boxed()
    }

    fn list_clusters(&self) -> StoreFuture<'_, Vec<ClusterRecord>> {
        async move {
            let rows = sqlx::query(concat!(
                "SELECT ",
                cluster_columns!(),
                " FROM clusters ORDER BY name"
            ))
            .fetch_all(&self.pool)
            .await?;
            rows.iter().map(cluster_from_row).collect()
        }
        .boxed()
    }

    fn delete_cluster<'a>(&'a self, name: &'a str) -> StoreFuture<'a, bool> {
        async move {
            let mut tx = self.pool.begin_with(BEGIN_WRITE).await?;
            let done = sqlx::query("DELETE FROM clusters WHERE name = $1")
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

    fn secrets<'a>(&'a self, name: &'a str) -> StoreFuture<'a, Option<ClusterSecrets>> {
        async move {
            let row = sqlx::query(
                "SELECT onboarding_token_hash, onboarding_used FROM clusters WHERE name = $1",
            )
            .bind(name)
            .fetch_optional(&self.pool)
            .await?;
            let Some(row) = row else { return Ok(None) };
            let token: Option<String> = row.try_get("onboarding_token_hash")?;
            Ok(Some(ClusterSecrets {
                onboarding_token_hash: token.as_deref().map(TokenHash::from_hex).transpose()?,
                onboarding_used: row.try_get("onboarding_used")?,
            }))
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
            let done = sqlx::query(
                "UPDATE clusters SET onboarding_used = $1, identity_fingerprint = $2, identity_not_after = $3, \
                 previous_fingerprint = NULL, onboarded_at = $4 \
                 WHERE name = $5 AND onboarding_token_hash = $6 AND onboarding_used = $7",
            )
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

    fn renew_identity<'a>(
        &'a self,
        name: &'a str,
        presented: &'a str,
        identity: &'a NewIdentity,
    ) -> StoreFuture<'a, bool> {
        async move {
            let done = sqlx::query(
                "UPDATE clusters SET previous_fingerprint = $1, identity_fingerprint = $2, identity_not_after = $3 \
                 WHERE name = $4 AND (identity_fingerprint = $5 OR previous_fingerprint = $6)",
            )
            .bind(presented)
            .bind(&identity.fingerprint)
            .bind(ts(identity.not_after))
            .bind(name)
            .bind(presented)
            .bind(presented)
            .execute(&self.pool)
            .await?;
            Ok(done.rows_affected() == 1)
        }
        .boxed()
    }

    fn confirm_identity<'a>(&'a self, name: &'a str, fingerprint: &'a str) -> StoreFuture<'a, ()> {
        async move {
            sqlx::query(
                "UPDATE clusters SET previous_fingerprint = NULL \
                 WHERE name = $1 AND identity_fingerprint = $2 AND previous_fingerprint IS NOT NULL",
            )
            .bind(name)
            .bind(fingerprint)
            .execute(&self.pool)
            .await?;
            Ok(())
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
            sqlx::query(
                "UPDATE clusters SET connected_since = $1, last_seen = $2, agent_version = $3 WHERE name = $4",
            )
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

    fn record_activity<'a>(&'a self, batch: &'a [Activity]) -> StoreFuture<'a, ()> {
        async move {
            if batch.is_empty() {
                return Ok(());
            }
            let mut tx = self.pool.begin_with(BEGIN_WRITE).await?;
            for a in batch {
                let health = a.health.as_ref().map(|h| to_json(h, "health")).transpose()?;
                // COALESCE keeps what the batch does not carry; CASE keeps last_seen monotonic.
                sqlx::query(
                    "UPDATE clusters SET \
                     last_seen = CASE WHEN last_seen IS NULL OR last_seen < $1 THEN $2 ELSE last_seen END, \
                     health = COALESCE($3, health), agent_version = COALESCE($4, agent_version) \
                     WHERE name = $5",
                )
                .bind(ts(a.seen_at))
                .bind(ts(a.seen_at))
                .bind(health)
                .bind(a.agent_version.as_deref())
                .bind(&a.name)
                .execute(&mut *tx)
                .await?;
            }
            tx.commit().await?;
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
            sqlx::query("UPDATE clusters SET metadata = $1, agent_version = $2 WHERE name = $3")
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
            sqlx::query("UPDATE clusters SET connected_since = NULL WHERE name = $1")
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
            let rows: Vec<String> = sqlx::query_scalar(
                "SELECT definition FROM role_definitions WHERE builtin = $1 ORDER BY id_key",
            )
            .bind(false)
            .fetch_all(&self.pool)
            .await?;
            rows.iter().map(|t| role_from_json(t)).collect()
        }
        .boxed()
    }

    fn delete_role_definition<'a>(&'a self, id: &'a str) -> StoreFuture<'a, bool> {
        async move {
            let result =
                sqlx::query("DELETE FROM role_definitions WHERE id_key = $1 AND builtin = $2")
                    .bind(id.to_ascii_lowercase())
                    .bind(false)
                    .execute(&self.pool)
                    .await;
            match result {
                Ok(done) => Ok(done.rows_affected() > 0),
                Err(e) if is_foreign_key_violation(&e) => Err(StoreError::Conflict(format!(
                    "role definition {id:?} is assigned: delete its role assignments first"
                ))),
                Err(e) => Err(e.into()),
            }
        }
        .boxed()
    }

    fn create_role_assignment<'a>(
        &'a self,
        assignment: &'a RoleAssignmentRecord,
    ) -> StoreFuture<'a, u64> {
        async move {
            let mut tx = self.pool.begin_with(BEGIN_WRITE).await?;
            let version = bump_guard_version(&mut tx, &assignment.cluster)
                .await?
                .ok_or_else(|| {
                    StoreError::NotFound(format!("clusters \"{}\" not found", assignment.cluster))
                })?;
            insert_assignment(&mut tx, assignment).await?;
            let now = OffsetDateTime::now_utc();
            record_change(
                &mut tx,
                &assignment.cluster,
                ChangeKind::Guard(version),
                now,
            )
            .await?;
            tx.commit().await?;
            self.signal_change();
            Ok(version)
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
                    sqlx::query(concat!(
                        "SELECT ",
                        assignment_columns!(),
                        " FROM role_assignments WHERE cluster = $1 ORDER BY id"
                    ))
                    .bind(cluster)
                    .fetch_all(&self.pool)
                    .await?
                }
                None => {
                    sqlx::query(concat!(
                        "SELECT ",
                        assignment_columns!(),
                        " FROM role_assignments ORDER BY cluster, id"
                    ))
                    .fetch_all(&self.pool)
                    .await?
                }
            };
            rows.iter().map(assignment_from_row).collect()
        }
        .boxed()
    }

    fn delete_role_assignment<'a>(&'a self, id: &'a str) -> StoreFuture<'a, Option<(String, u64)>> {
        async move {
            let mut tx = self.pool.begin_with(BEGIN_WRITE).await?;
            let cluster: Option<String> =
                sqlx::query_scalar("DELETE FROM role_assignments WHERE id = $1 RETURNING cluster")
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

    fn create_deny_assignment<'a>(
        &'a self,
        deny: &'a DenyAssignmentRecord,
    ) -> StoreFuture<'a, u64> {
        async move {
            let mut tx = self.pool.begin_with(BEGIN_WRITE).await?;
            let version = bump_guard_version(&mut tx, &deny.cluster)
                .await?
                .ok_or_else(|| {
                    StoreError::NotFound(format!("clusters \"{}\" not found", deny.cluster))
                })?;
            insert_deny(&mut tx, deny).await?;
            let now = OffsetDateTime::now_utc();
            record_change(&mut tx, &deny.cluster, ChangeKind::Guard(version), now).await?;
            tx.commit().await?;
            self.signal_change();
            Ok(version)
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
                    sqlx::query("SELECT * FROM deny_assignments WHERE cluster = $1 ORDER BY id")
                        .bind(cluster)
                        .fetch_all(&self.pool)
                        .await?
                }
                None => {
                    sqlx::query("SELECT * FROM deny_assignments ORDER BY cluster, id")
                        .fetch_all(&self.pool)
                        .await?
                }
            };
            rows.iter().map(deny_from_row).collect()
        }
        .boxed()
    }

    fn delete_deny_assignment<'a>(&'a self, id: &'a str) -> StoreFuture<'a, Option<(String, u64)>> {
        async move {
            let mut tx = self.pool.begin_with(BEGIN_WRITE).await?;
            let cluster: Option<String> =
                sqlx::query_scalar("DELETE FROM deny_assignments WHERE id = $1 RETURNING cluster")
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

    fn guard_state<'a>(&'a self, cluster: &'a str) -> StoreFuture<'a, Option<GuardState>> {
        async move {
            // One read transaction: the version and the contents are from the same instant.
            let mut tx = self.pool.begin().await?;
            let version: Option<i64> =
                sqlx::query_scalar("SELECT guard_version FROM clusters WHERE name = $1")
                    .bind(cluster)
                    .fetch_optional(&mut *tx)
                    .await?;
            let Some(version) = version else {
                return Ok(None);
            };
            let assignments = sqlx::query(concat!(
                "SELECT ",
                assignment_columns!(),
                " FROM role_assignments WHERE cluster = $1 ORDER BY id"
            ))
            .bind(cluster)
            .fetch_all(&mut *tx)
            .await?;
            let denies =
                sqlx::query("SELECT * FROM deny_assignments WHERE cluster = $1 ORDER BY id")
                    .bind(cluster)
                    .fetch_all(&mut *tx)
                    .await?;
            let roles: Vec<String> = sqlx::query_scalar(
                "SELECT definition FROM role_definitions WHERE builtin = $1 AND id IN \
                 (SELECT role_id FROM role_assignments WHERE cluster = $2) ORDER BY id_key",
            )
            .bind(false)
            .bind(cluster)
            .fetch_all(&mut *tx)
            .await?;
            tx.commit().await?;
            Ok(Some(GuardState {
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
            }))
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
            insert_cluster(&mut tx, new).await?;
            for role in roles {
                insert_role(&mut tx, role, new.created_at, true).await?;
            }
            for a in assignments {
                insert_assignment(&mut tx, a).await?;
            }
            for d in denies {
                insert_deny(&mut tx, d).await?;
            }
            record_change(
                &mut tx,
                &new.name,
                ChangeKind::Created,
                OffsetDateTime::now_utc(),
            )
            .await?;
            tx.commit().await?;
            self.signal_change();
            new_record(new)
        }
        .boxed()
    }

    fn set_directory_entry<'a>(&'a self, entry: &'a DirectoryEntry) -> StoreFuture<'a, ()> {
        async move {
            sqlx::query(
                "INSERT INTO directory_users (oid, tid, groups, updated_at) VALUES ($1, $2, $3, $4) \
                 ON CONFLICT (oid) DO UPDATE SET tid = excluded.tid, groups = excluded.groups, \
                 updated_at = excluded.updated_at",
            )
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
            let row = sqlx::query(
                "SELECT oid, tid, groups, updated_at FROM directory_users WHERE oid = $1",
            )
            .bind(oid)
            .fetch_optional(&self.pool)
            .await?;
            row.map(|row| {
                Ok(DirectoryEntry {
                    oid: row.try_get("oid")?,
                    tid: row.try_get("tid")?,
                    groups: string_list(&row, "groups")?,
                    updated_at: from_ts(row.try_get("updated_at")?)?,
                })
            })
            .transpose()
        }
        .boxed()
    }

    fn delete_directory_entry<'a>(&'a self, oid: &'a str) -> StoreFuture<'a, bool> {
        async move {
            let done = sqlx::query("DELETE FROM directory_users WHERE oid = $1")
                .bind(oid)
                .execute(&self.pool)
                .await?;
            Ok(done.rows_affected() > 0)
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
            let done = sqlx::query("UPDATE clusters SET tags = $1 WHERE name = $2")
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
            let (head, pruned_through): (i64, i64) =
                sqlx::query_as("SELECT seq, pruned_through FROM change_log_head WHERE id = 1")
                    .fetch_one(&mut *tx)
                    .await?;
            let head = version_from_db(head)?;
            let pruned_through = version_from_db(pruned_through)?;
            if after < pruned_through || after > head {
                return Ok(ChangePage {
                    changes: Vec::new(),
                    head,
                    reset: true,
                });
            }
            let rows = sqlx::query(
                "SELECT seq, cluster, kind, guard_version, changed_at FROM cluster_changes \
                 WHERE seq > $1 ORDER BY seq LIMIT $2",
            )
            .bind(version_to_db(after))
            .bind(i64::from(limit))
            .fetch_all(&mut *tx)
            .await?;
            tx.commit().await?;
            Ok(ChangePage {
                changes: rows.iter().map(change_from_row).collect::<Result<_, _>>()?,
                head,
                reset: false,
            })
        }
        .boxed()
    }

    fn prune_changes(&self, before: OffsetDateTime) -> StoreFuture<'_, u64> {
        async move {
            let mut tx = self.pool.begin_with(BEGIN_WRITE).await?;
            let through: Option<i64> =
                sqlx::query_scalar("SELECT MAX(seq) FROM cluster_changes WHERE changed_at < $1")
                    .bind(ts(before))
                    .fetch_one(&mut *tx)
                    .await?;
            let Some(through) = through else {
                return Ok(0);
            };
            // Entries are appended in time order per replica, but clocks differ: remove everything up to
            // the newest old entry, so the log stays a suffix and `pruned_through` stays exact.
            let done = sqlx::query("DELETE FROM cluster_changes WHERE seq <= $1")
                .bind(through)
                .execute(&mut *tx)
                .await?;
            sqlx::query(
                "UPDATE change_log_head SET pruned_through = $1 WHERE id = 1 AND pruned_through < $2",
            )
            .bind(through)
            .bind(through)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            Ok(done.rows_affected())
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

    fn close(&self) -> StoreFuture<'_, ()> {
        async move {
            self.pool.close().await;
            Ok(())
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

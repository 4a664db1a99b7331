//! The default [`Store`]: SQLite through sqlx, WAL mode, embedded migrations.
//!
//! Queries are plain runtime SQL with `$n` placeholders, which PostgreSQL understands too.

use std::collections::BTreeMap;
use std::str::FromStr;
use std::time::Duration;

use futures_util::FutureExt;
use sqlx::Row;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow,
    SqliteSynchronous,
};
use time::OffsetDateTime;

use super::{
    Activity, ClusterIdentity, ClusterMetadata, ClusterRecord, ClusterSecrets, NewCluster,
    NewIdentity, Store, StoreError, StoreFuture, TokenHash,
};

/// SQLite implementation of [`Store`].
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
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
        Ok(Self { pool })
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
            let tags = to_json(&new.tags, "tags")?;
            let result = sqlx::query(
                "INSERT INTO clusters (name, tags, created_at, onboarding_token_hash, onboarding_used) \
                 VALUES ($1, $2, $3, $4, $5)",
            )
            .bind(&new.name)
            .bind(tags)
            .bind(ts(new.created_at))
            .bind(new.onboarding_token_hash.to_hex())
            .bind(false)
            .execute(&self.pool)
            .await;
            match result {
                Ok(_) => {}
                Err(e) if e.as_database_error().is_some_and(|d| d.is_unique_violation()) => {
                    return Err(StoreError::AlreadyExists(new.name.clone()));
                }
                Err(e) => return Err(e.into()),
            }
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
            let done = sqlx::query("DELETE FROM clusters WHERE name = $1")
                .bind(name)
                .execute(&self.pool)
                .await?;
            Ok(done.rows_affected() > 0)
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
            let mut tx = self.pool.begin().await?;
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
    use super::*;
    use crate::store::AgentHealth;

    fn new_cluster(name: &str, token: &str) -> NewCluster {
        NewCluster {
            name: name.into(),
            tags: BTreeMap::from([("env".to_string(), "test".to_string())]),
            onboarding_token_hash: TokenHash::of(token),
            created_at: OffsetDateTime::from_unix_timestamp(1_700_000_000)
                .expect("valid timestamp"),
        }
    }

    async fn memory() -> SqliteStore {
        SqliteStore::open("sqlite::memory:")
            .await
            .expect("in-memory store opens")
    }

    #[tokio::test]
    async fn create_get_list_delete() {
        let store = memory().await;
        let created = store
            .create_cluster(&new_cluster("b", "t1"))
            .await
            .expect("create b");
        store
            .create_cluster(&new_cluster("a", "t2"))
            .await
            .expect("create a");
        assert!(matches!(
            store.create_cluster(&new_cluster("a", "t3")).await,
            Err(StoreError::AlreadyExists(n)) if n == "a"
        ));
        let got = store.cluster("b").await.expect("query").expect("b exists");
        assert_eq!(got, created);
        assert_eq!(got.tags["env"], "test");
        let names: Vec<_> = store
            .list_clusters()
            .await
            .expect("list")
            .into_iter()
            .map(|c| c.name)
            .collect();
        assert_eq!(names, ["a", "b"]);
        assert!(store.delete_cluster("a").await.expect("delete"));
        assert!(!store.delete_cluster("a").await.expect("delete again"));
        assert!(store.cluster("a").await.expect("query").is_none());
        assert!(store.secrets("a").await.expect("query").is_none());
    }

    fn identity(fingerprint: &str) -> NewIdentity {
        NewIdentity {
            fingerprint: fingerprint.into(),
            not_after: OffsetDateTime::from_unix_timestamp(1_900_000_000).expect("valid"),
        }
    }

    #[tokio::test]
    async fn onboarding_token_redeems_once() {
        let store = memory().await;
        store
            .create_cluster(&new_cluster("c", "token"))
            .await
            .expect("create");
        let now = OffsetDateTime::now_utc();
        let first = identity("aa");
        assert!(
            !store
                .redeem_onboarding_token("c", &TokenHash::of("wrong"), &first, now)
                .await
                .expect("redeem")
        );
        assert!(
            !store
                .redeem_onboarding_token("nope", &TokenHash::of("token"), &first, now)
                .await
                .expect("redeem")
        );
        assert!(
            store
                .redeem_onboarding_token("c", &TokenHash::of("token"), &first, now)
                .await
                .expect("redeem")
        );
        assert!(
            !store
                .redeem_onboarding_token("c", &TokenHash::of("token"), &identity("bb"), now)
                .await
                .expect("redeem")
        );
        let secrets = store.secrets("c").await.expect("query").expect("exists");
        assert!(secrets.onboarding_used);
        let c = store.cluster("c").await.expect("query").expect("exists");
        assert!(c.onboarded);
        assert_eq!(
            c.identity,
            Some(ClusterIdentity {
                fingerprint: "aa".into(),
                not_after: first.not_after,
                previous_fingerprint: None,
            })
        );
    }

    #[tokio::test]
    async fn renewal_keeps_the_presented_certificate_until_confirmed() {
        let store = memory().await;
        store
            .create_cluster(&new_cluster("c", "token"))
            .await
            .expect("create");
        let now = OffsetDateTime::now_utc();
        store
            .redeem_onboarding_token("c", &TokenHash::of("token"), &identity("a"), now)
            .await
            .expect("redeem");
        assert!(
            !store
                .renew_identity("c", "unknown", &identity("x"))
                .await
                .expect("renew"),
            "only the current or previous certificate may renew"
        );
        assert!(
            store
                .renew_identity("c", "a", &identity("b"))
                .await
                .expect("renew")
        );
        let id = store
            .cluster("c")
            .await
            .expect("q")
            .expect("c")
            .identity
            .expect("identity");
        assert!(id.accepts("a") && id.accepts("b") && !id.accepts("x"));
        // The agent lost "b" and renews again with "a": "a" stays accepted, "b" is gone.
        assert!(
            store
                .renew_identity("c", "a", &identity("c"))
                .await
                .expect("renew")
        );
        let id = store
            .cluster("c")
            .await
            .expect("q")
            .expect("c")
            .identity
            .expect("identity");
        assert!(id.accepts("a") && id.accepts("c") && !id.accepts("b"));
        // Confirming with the previous certificate changes nothing; with the current one forgets the previous.
        store.confirm_identity("c", "a").await.expect("confirm");
        let id = store
            .cluster("c")
            .await
            .expect("q")
            .expect("c")
            .identity
            .expect("identity");
        assert_eq!(id.previous_fingerprint.as_deref(), Some("a"));
        store.confirm_identity("c", "c").await.expect("confirm");
        let id = store
            .cluster("c")
            .await
            .expect("q")
            .expect("c")
            .identity
            .expect("identity");
        assert!(!id.accepts("a") && id.accepts("c"));
        assert!(
            !store
                .renew_identity("gone", "c", &identity("d"))
                .await
                .expect("renew")
        );
    }

    #[tokio::test]
    async fn connection_facts() {
        let store = memory().await;
        store
            .create_cluster(&new_cluster("c", "token"))
            .await
            .expect("create");
        let t1 = OffsetDateTime::from_unix_timestamp(1_800_000_000).expect("valid");
        let t2 = OffsetDateTime::from_unix_timestamp(1_800_000_060).expect("valid");
        store
            .record_connected("c", "v1.2.3", t1)
            .await
            .expect("connected");
        let c = store.cluster("c").await.expect("query").expect("exists");
        assert_eq!(
            (c.connected_since, c.last_seen, c.agent_version.as_deref()),
            (Some(t1), Some(t1), Some("v1.2.3"))
        );
        let health = AgentHealth {
            uptime_seconds: 5,
            memory_bytes: 1 << 20,
            cpu_seconds: 0.25,
            reconnects: 2,
            tunnel_rtt_millis: Some(1.5),
            reported_at: t2,
        };
        store
            .record_activity(&[
                Activity {
                    name: "c".into(),
                    seen_at: t2,
                    health: Some(health.clone()),
                    agent_version: Some("v1.2.4".into()),
                },
                Activity {
                    name: "unknown".into(),
                    seen_at: t2,
                    health: None,
                    agent_version: None,
                },
            ])
            .await
            .expect("activity");
        let c = store.cluster("c").await.expect("query").expect("exists");
        assert_eq!(c.last_seen, Some(t2));
        assert_eq!(c.health.as_ref(), Some(&health));
        assert_eq!(c.agent_version.as_deref(), Some("v1.2.4"));
        // An older time does not move last-seen back; a batch without health keeps the stored one.
        store
            .record_activity(&[Activity {
                name: "c".into(),
                seen_at: t1,
                health: None,
                agent_version: None,
            }])
            .await
            .expect("activity");
        let c = store.cluster("c").await.expect("query").expect("exists");
        assert_eq!((c.last_seen, c.health.as_ref()), (Some(t2), Some(&health)));

        let metadata = ClusterMetadata {
            kubernetes_version: "v1.33.1".into(),
            node_count: 3,
            total_cpu_millis: 6000,
            total_memory_bytes: 8 << 30,
            distribution: "kind".into(),
            infrastructure: "generic".into(),
            reported_at: t2,
        };
        store
            .record_metadata("c", &metadata, "v1.2.5")
            .await
            .expect("metadata");
        store.record_disconnected("c").await.expect("disconnected");
        let c = store.cluster("c").await.expect("query").expect("exists");
        assert_eq!((c.connected_since, c.last_seen), (None, Some(t2)));
        assert_eq!(c.metadata, Some(metadata));
        assert_eq!(c.agent_version.as_deref(), Some("v1.2.5"));
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

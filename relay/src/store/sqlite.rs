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

use super::{ClusterRecord, ClusterSecrets, NewCluster, Store, StoreError, StoreFuture, TokenHash};

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

fn cluster_from_row(row: &SqliteRow) -> Result<ClusterRecord, StoreError> {
    let tags: String = row.try_get("tags")?;
    let tags: BTreeMap<String, String> =
        serde_json::from_str(&tags).map_err(|e| StoreError::Corrupt(format!("tags: {e}")))?;
    Ok(ClusterRecord {
        name: row.try_get("name")?,
        tags,
        created_at: from_ts(row.try_get("created_at")?)?,
        onboarded: row.try_get("onboarding_used")?,
        connected_since: opt_ts(row.try_get("connected_since")?)?,
        last_seen: opt_ts(row.try_get("last_seen")?)?,
        agent_version: row.try_get("agent_version")?,
    })
}

impl Store for SqliteStore {
    fn create_cluster<'a>(&'a self, new: &'a NewCluster) -> StoreFuture<'a, ClusterRecord> {
        async move {
            let tags = serde_json::to_string(&new.tags).map_err(|e| StoreError::Corrupt(format!("tags: {e}")))?;
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
            })
        }
        .boxed()
    }

    fn cluster<'a>(&'a self, name: &'a str) -> StoreFuture<'a, Option<ClusterRecord>> {
        async move {
            let row = sqlx::query(
                "SELECT name, tags, created_at, onboarding_used, connected_since, last_seen, agent_version \
                 FROM clusters WHERE name = $1",
            ).bind(name).fetch_optional(&self.pool).await?;
            row.as_ref().map(cluster_from_row).transpose()
        }
        .boxed()
    }

    fn list_clusters(&self) -> StoreFuture<'_, Vec<ClusterRecord>> {
        async move {
            let rows = sqlx::query(
                "SELECT name, tags, created_at, onboarding_used, connected_since, last_seen, agent_version \
                 FROM clusters ORDER BY name",
            ).fetch_all(&self.pool).await?;
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
                "SELECT onboarding_token_hash, onboarding_used, credential_hash FROM clusters WHERE name = $1",
            )
            .bind(name)
            .fetch_optional(&self.pool)
            .await?;
            let Some(row) = row else { return Ok(None) };
            let token: Option<String> = row.try_get("onboarding_token_hash")?;
            let credential: Option<String> = row.try_get("credential_hash")?;
            Ok(Some(ClusterSecrets {
                onboarding_token_hash: token.as_deref().map(TokenHash::from_hex).transpose()?,
                onboarding_used: row.try_get("onboarding_used")?,
                credential_hash: credential.as_deref().map(TokenHash::from_hex).transpose()?,
            }))
        }
        .boxed()
    }

    fn redeem_onboarding_token<'a>(
        &'a self,
        name: &'a str,
        token: &'a TokenHash,
        credential: &'a TokenHash,
        at: OffsetDateTime,
    ) -> StoreFuture<'a, bool> {
        async move {
            // One conditional UPDATE: two concurrent redemptions cannot both see the token unused.
            let done = sqlx::query(
                "UPDATE clusters SET onboarding_used = $1, credential_hash = $2, onboarded_at = $3 \
                 WHERE name = $4 AND onboarding_token_hash = $5 AND onboarding_used = $6",
            )
            .bind(true)
            .bind(credential.to_hex())
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

    fn record_seen<'a>(&'a self, name: &'a str, at: OffsetDateTime) -> StoreFuture<'a, ()> {
        async move {
            sqlx::query("UPDATE clusters SET last_seen = $1 WHERE name = $2")
                .bind(ts(at))
                .bind(name)
                .execute(&self.pool)
                .await?;
            Ok(())
        }
        .boxed()
    }

    fn record_disconnected<'a>(&'a self, name: &'a str, at: OffsetDateTime) -> StoreFuture<'a, ()> {
        async move {
            sqlx::query(
                "UPDATE clusters SET connected_since = NULL, last_seen = $1 WHERE name = $2",
            )
            .bind(ts(at))
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

    #[tokio::test]
    async fn onboarding_token_redeems_once() {
        let store = memory().await;
        store
            .create_cluster(&new_cluster("c", "token"))
            .await
            .expect("create");
        let now = OffsetDateTime::now_utc();
        let cred = TokenHash::of("cred");
        assert!(
            !store
                .redeem_onboarding_token("c", &TokenHash::of("wrong"), &cred, now)
                .await
                .expect("redeem")
        );
        assert!(
            !store
                .redeem_onboarding_token("nope", &TokenHash::of("token"), &cred, now)
                .await
                .expect("redeem")
        );
        assert!(
            store
                .redeem_onboarding_token("c", &TokenHash::of("token"), &cred, now)
                .await
                .expect("redeem")
        );
        let other = TokenHash::of("cred2");
        assert!(
            !store
                .redeem_onboarding_token("c", &TokenHash::of("token"), &other, now)
                .await
                .expect("redeem")
        );
        let secrets = store.secrets("c").await.expect("query").expect("exists");
        assert!(secrets.onboarding_used);
        assert!(secrets.credential_hash.is_some_and(|h| h.ct_eq(&cred)));
        assert!(
            store
                .cluster("c")
                .await
                .expect("query")
                .expect("exists")
                .onboarded
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
        store.record_seen("c", t2).await.expect("seen");
        assert_eq!(
            store
                .cluster("c")
                .await
                .expect("query")
                .expect("exists")
                .last_seen,
            Some(t2)
        );
        store
            .record_disconnected("c", t2)
            .await
            .expect("disconnected");
        let c = store.cluster("c").await.expect("query").expect("exists");
        assert_eq!((c.connected_since, c.last_seen), (None, Some(t2)));
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

//! Persistent state: clusters, the hashes of their onboarding tokens and credentials, and connection facts.
//!
//! [`Store`] is deliberately narrow and backend-neutral (no SQL in its signatures, timestamps as
//! [`OffsetDateTime`], hashes as [`TokenHash`]) so that a PostgreSQL implementation can sit beside
//! [`SqliteStore`] when several relay replicas share state. Secrets never reach the store: only SHA-256
//! hashes of them.

mod sqlite;

use std::collections::BTreeMap;

use futures_util::future::BoxFuture;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use time::OffsetDateTime;

pub use sqlite::SqliteStore;

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A cluster with this name already exists.
    #[error("cluster {0:?} already exists")]
    AlreadyExists(String),
    /// The database failed.
    #[error("database error: {0}")]
    Database(#[source] sqlx::Error),
    /// Applying the schema migrations failed.
    #[error("schema migration failed: {0}")]
    Migrate(#[source] sqlx::migrate::MigrateError),
    /// A stored value could not be decoded.
    #[error("corrupt stored value: {0}")]
    Corrupt(String),
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        StoreError::Database(e)
    }
}

/// The result of a [`Store`] operation.
pub type StoreFuture<'a, T> = BoxFuture<'a, Result<T, StoreError>>;

/// SHA-256 of a token or credential. The only form in which secrets are stored.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct TokenHash([u8; 32]);

impl TokenHash {
    /// Hashes a secret value.
    pub fn of(secret: &str) -> Self {
        Self(Sha256::digest(secret.as_bytes()).into())
    }

    /// Compares in constant time.
    pub fn ct_eq(&self, other: &TokenHash) -> bool {
        self.0.ct_eq(&other.0).into()
    }

    /// Lowercase hex, for storage.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Parses the form written by [`TokenHash::to_hex`].
    pub fn from_hex(s: &str) -> Result<Self, StoreError> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out)
            .map_err(|e| StoreError::Corrupt(format!("token hash: {e}")))?;
        Ok(Self(out))
    }
}

impl std::fmt::Debug for TokenHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A hash of a high-entropy secret is not secret itself, but there is no reason to print it either.
        f.write_str("TokenHash(..)")
    }
}

/// A cluster as stored (no secrets).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterRecord {
    /// Unique name (a DNS-1123 label).
    pub name: String,
    /// Free-form labels given at registration.
    pub tags: BTreeMap<String, String>,
    /// When it was registered.
    pub created_at: OffsetDateTime,
    /// Whether its onboarding token was redeemed for a credential.
    pub onboarded: bool,
    /// When its current tunnel connected (`None` when no tunnel is recorded).
    pub connected_since: Option<OffsetDateTime>,
    /// When its agent was last known to be connected.
    pub last_seen: Option<OffsetDateTime>,
    /// The version its agent reported when it last connected.
    pub agent_version: Option<String>,
}

/// What is needed to register a cluster.
#[derive(Debug, Clone)]
pub struct NewCluster {
    /// Unique name (a DNS-1123 label, validated by the caller).
    pub name: String,
    /// Free-form labels.
    pub tags: BTreeMap<String, String>,
    /// Hash of the one-time onboarding token handed to the operator.
    pub onboarding_token_hash: TokenHash,
    /// Registration time.
    pub created_at: OffsetDateTime,
}

/// The hashes stored for a cluster, for constant-time comparison by the caller.
#[derive(Debug, Clone)]
pub struct ClusterSecrets {
    /// Hash of the onboarding token.
    pub onboarding_token_hash: Option<TokenHash>,
    /// Whether the onboarding token was already used.
    pub onboarding_used: bool,
    /// Hash of the agent credential, once onboarded.
    pub credential_hash: Option<TokenHash>,
}

/// Persistent relay state. Implementations must be safe to share between tasks; every method is one atomic
/// operation.
pub trait Store: Send + Sync + 'static {
    /// Registers a cluster; [`StoreError::AlreadyExists`] if the name is taken.
    fn create_cluster<'a>(&'a self, new: &'a NewCluster) -> StoreFuture<'a, ClusterRecord>;

    /// One cluster by name.
    fn cluster<'a>(&'a self, name: &'a str) -> StoreFuture<'a, Option<ClusterRecord>>;

    /// All clusters, ordered by name.
    fn list_clusters(&self) -> StoreFuture<'_, Vec<ClusterRecord>>;

    /// Removes a cluster and its credential; false if there was none.
    fn delete_cluster<'a>(&'a self, name: &'a str) -> StoreFuture<'a, bool>;

    /// The stored hashes of a cluster, `None` for an unknown cluster.
    fn secrets<'a>(&'a self, name: &'a str) -> StoreFuture<'a, Option<ClusterSecrets>>;

    /// Atomically marks the onboarding token used and stores the credential hash, only if the cluster exists,
    /// its token hash equals `token` and it was not used yet. True when this call redeemed it.
    fn redeem_onboarding_token<'a>(
        &'a self,
        name: &'a str,
        token: &'a TokenHash,
        credential: &'a TokenHash,
        at: OffsetDateTime,
    ) -> StoreFuture<'a, bool>;

    /// Records that the cluster's agent connected (sets connected-since, last-seen and agent version).
    fn record_connected<'a>(
        &'a self,
        name: &'a str,
        agent_version: &'a str,
        at: OffsetDateTime,
    ) -> StoreFuture<'a, ()>;

    /// Records that the cluster's agent is still connected.
    fn record_seen<'a>(&'a self, name: &'a str, at: OffsetDateTime) -> StoreFuture<'a, ()>;

    /// Records that the cluster's agent disconnected (clears connected-since, sets last-seen).
    fn record_disconnected<'a>(&'a self, name: &'a str, at: OffsetDateTime) -> StoreFuture<'a, ()>;

    /// Flushes and closes the backend.
    fn close(&self) -> StoreFuture<'_, ()>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_hash_roundtrip_and_compare() {
        let a = TokenHash::of("secret-a");
        let b = TokenHash::of("secret-b");
        assert!(a.ct_eq(&a));
        assert!(!a.ct_eq(&b));
        let parsed = TokenHash::from_hex(&a.to_hex()).expect("hex parses");
        assert!(parsed.ct_eq(&a));
        assert!(TokenHash::from_hex("zz").is_err());
        assert_eq!(format!("{a:?}"), "TokenHash(..)");
        // Known SHA-256 vector.
        assert_eq!(
            TokenHash::of("abc").to_hex(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}

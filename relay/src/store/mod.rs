//! Persistent state: clusters, the hashes of their onboarding tokens, their identities (certificate
//! fingerprints and expiry), what their agents report (connectivity, metadata, health), guard's RBAC (custom
//! role definitions, role and deny assignments per cluster, a per-cluster snapshot version) and the group
//! directory used for group overage.
//!
//! [`Store`] is deliberately narrow and backend-neutral (no SQL in its signatures, timestamps as
//! [`OffsetDateTime`], hashes as [`TokenHash`]). Two backends implement it: [`SqliteStore`] (the default, one
//! relay process) and [`PostgresStore`] (several relay replicas sharing one database); [`open`] picks one from
//! the URL scheme. Secrets never reach the store: only SHA-256 hashes of them. Certificates are not stored
//! either, only their fingerprints.
//!
//! Every change another replica must act on (a cluster created or deleted, its tags or its guard snapshot
//! changed) is also appended, in the same transaction, to a change log with a database-wide sequence number;
//! [`ChangeFeed`] follows that log, woken by PostgreSQL `LISTEN/NOTIFY` where available and by a periodic
//! re-read in any case, so a lost notification only delays a change, never loses it.
//!
//! For a relay fleet it also holds each replica's lease and the tunnels each replica holds ([`ReplicaLease`],
//! [`TunnelRecord`], [`TunnelRoute`]): lease times come from the database's clock, so replicas need not agree on
//! the time, and a replica whose lease lapsed is ignored by every query at once.
//!
//! What it does not do: cache, or decide anything: callers check secrets and permissions.

mod feed;

mod postgres;
mod rows;
mod sqlite;

use std::collections::BTreeMap;
use std::sync::Arc;

use futures_util::future::BoxFuture;
use futures_util::stream::BoxStream;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tether_auth::rbac::RoleDefinition;
use time::OffsetDateTime;

pub use feed::{ChangeFeed, FeedEvent};

pub use postgres::PostgresStore;
pub use sqlite::SqliteStore;

/// The storage backend a database URL names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// `sqlite:PATH`, `sqlite://PATH` or `sqlite::memory:`.
    Sqlite,
    /// `postgres://…` or `postgresql://…`.
    Postgres,
}

impl Backend {
    /// The backend `url` names; [`StoreError::UnsupportedUrl`] for any other scheme. Cheap and offline, for
    /// validating configuration before anything is opened.
    pub fn of_url(url: &str) -> Result<Backend, StoreError> {
        let lower = url.to_ascii_lowercase();
        if lower.starts_with("sqlite:") {
            Ok(Backend::Sqlite)
        } else if lower.starts_with("postgres://") || lower.starts_with("postgresql://") {
            Ok(Backend::Postgres)
        } else {
            Err(StoreError::UnsupportedUrl(redact_url(url)))
        }
    }
}

/// `url` without a password, for error messages and logs.
fn redact_url(url: &str) -> String {
    // scheme://user:password@host… → scheme://user:***@host…
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
            if userinfo.contains(':') {
                format!("{scheme}://{user}:***@{host}{tail}")
            } else {
                url.to_owned()
            }
        }
        None => url.to_owned(),
    }
}

/// Opens the store `url` names and applies its migrations: SQLite for `sqlite:…`, PostgreSQL for
/// `postgres://…` / `postgresql://…`; [`StoreError::UnsupportedUrl`] for anything else.
pub async fn open(url: &str) -> Result<Arc<dyn Store>, StoreError> {
    match Backend::of_url(url)? {
        Backend::Sqlite => Ok(Arc::new(SqliteStore::open(url).await?)),
        Backend::Postgres => Ok(Arc::new(PostgresStore::open(url).await?)),
    }
}

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
    /// The operation conflicts with what is stored (a duplicate, or a role that is still assigned); the text
    /// says what, for people.
    #[error("{0}")]
    Conflict(String),
    /// Something the operation refers to does not exist (a cluster, a role); the text says what.
    #[error("{0}")]
    NotFound(String),
    /// The database URL names no supported backend (the URL is shown without its password).
    #[error(
        "unsupported database URL {0:?}: expected sqlite:PATH, sqlite::memory:, postgres://… or postgresql://…"
    )]
    UnsupportedUrl(String),
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
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterRecord {
    /// Unique name (a DNS-1123 label).
    pub name: String,
    /// Free-form labels given at registration.
    pub tags: BTreeMap<String, String>,
    /// When it was registered.
    pub created_at: OffsetDateTime,
    /// Whether its onboarding token was redeemed for an identity.
    pub onboarded: bool,
    /// When its current tunnel connected (`None` when no tunnel is recorded).
    pub connected_since: Option<OffsetDateTime>,
    /// The last time its agent was heard from: a tunnel connect or a heartbeat (`lastConnectivityTime`).
    pub last_seen: Option<OffsetDateTime>,
    /// The version its agent last reported.
    pub agent_version: Option<String>,
    /// Its current identity, once onboarded.
    pub identity: Option<ClusterIdentity>,
    /// The latest metadata its agent reported.
    pub metadata: Option<ClusterMetadata>,
    /// The latest health its agent reported.
    pub health: Option<AgentHealth>,
}

/// A cluster's identity: which client certificate the relay accepts for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterIdentity {
    /// SHA-256 of the current certificate's DER, lowercase hex.
    pub fingerprint: String,
    /// The current certificate's expiry.
    pub not_after: OffsetDateTime,
    /// The certificate the last renewal replaced: refused from that moment on, kept only to tell its holder
    /// why.
    pub previous_fingerprint: Option<String>,
}

impl ClusterIdentity {
    /// True when `fingerprint` is the current certificate (the only one accepted).
    pub fn accepts(&self, fingerprint: &str) -> bool {
        self.fingerprint == fingerprint
    }

    /// True when `fingerprint` is the certificate the last renewal replaced.
    pub fn was_replaced(&self, fingerprint: &str) -> bool {
        self.previous_fingerprint.as_deref() == Some(fingerprint)
    }
}

/// A newly issued certificate, as the store keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewIdentity {
    /// SHA-256 of its DER, lowercase hex.
    pub fingerprint: String,
    /// Its expiry.
    pub not_after: OffsetDateTime,
}

/// What an agent reports about its cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterMetadata {
    /// The apiserver's version.
    pub kubernetes_version: String,
    /// Number of nodes.
    pub node_count: u64,
    /// Total CPU capacity, millicores.
    pub total_cpu_millis: u64,
    /// Total memory capacity, bytes.
    pub total_memory_bytes: u64,
    /// Kubernetes distribution (`k3s`, `eks`, … or `generic`).
    pub distribution: String,
    /// Infrastructure (`aws`, `gcp`, … or `generic`).
    pub infrastructure: String,
    /// When the relay received it.
    #[serde(with = "time::serde::timestamp")]
    pub reported_at: OffsetDateTime,
}

/// What an agent reports about itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentHealth {
    /// Seconds since the agent started.
    pub uptime_seconds: u64,
    /// The agent's resident memory, bytes.
    pub memory_bytes: u64,
    /// CPU time the agent used, seconds.
    pub cpu_seconds: f64,
    /// Tunnel reconnects since the agent started.
    pub reconnects: u64,
    /// The tunnel's round-trip time, when measured.
    pub tunnel_rtt_millis: Option<f64>,
    /// When the relay received it.
    #[serde(with = "time::serde::timestamp")]
    pub reported_at: OffsetDateTime,
}

/// Connectivity facts gathered in memory for one cluster and written in a batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Activity {
    /// The cluster.
    pub name: String,
    /// The last time its agent was heard from.
    pub seen_at: OffsetDateTime,
    /// The latest health report, if one came since the last batch.
    pub health: Option<AgentHealth>,
    /// The agent version from that report.
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

/// The onboarding secrets stored for a cluster, for constant-time comparison by the caller.
#[derive(Debug, Clone)]
pub struct ClusterSecrets {
    /// Hash of the onboarding token.
    pub onboarding_token_hash: Option<TokenHash>,
    /// Whether the onboarding token was already used.
    pub onboarding_used: bool,
}

/// A role assignment: a role given to a principal on one cluster, or one namespace of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoleAssignmentRecord {
    /// Unique id.
    pub id: String,
    /// The role's id exactly as stored (a built-in GUID or a custom role's id).
    pub role_id: String,
    /// The object id of a user, service principal or group.
    pub principal_id: String,
    /// The cluster it applies to.
    pub cluster: String,
    /// The namespace it is limited to; `None`: the whole cluster.
    pub namespace: Option<String>,
    /// When it was made.
    pub created_at: OffsetDateTime,
}

/// A deny assignment: data actions refused to principals on one cluster, or one namespace of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DenyAssignmentRecord {
    /// Unique id.
    pub id: String,
    /// Display name.
    pub name: String,
    /// Denied data action patterns.
    pub data_actions: Vec<String>,
    /// Patterns carved out of `data_actions`.
    pub not_data_actions: Vec<String>,
    /// Object ids it applies to (the Everyone id or `*` for all).
    pub principals: Vec<String>,
    /// Object ids it does not apply to.
    pub exclude_principals: Vec<String>,
    /// The cluster it applies to.
    pub cluster: String,
    /// The namespace it is limited to; `None`: the whole cluster.
    pub namespace: Option<String>,
    /// When it was made.
    pub created_at: OffsetDateTime,
}

/// Everything a cluster's guard snapshot is made of, read at one instant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuardState {
    /// The cluster's snapshot version.
    pub version: u64,
    /// The custom roles its assignments use.
    pub roles: Vec<RoleDefinition>,
    /// Its role assignments, by id.
    pub assignments: Vec<RoleAssignmentRecord>,
    /// Its deny assignments, by id.
    pub deny_assignments: Vec<DenyAssignmentRecord>,
}

/// A user's groups in the relay's directory (for tokens with a group overage).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirectoryEntry {
    /// The user's object id.
    pub oid: String,
    /// The user's tenant; `None` matches any tenant.
    pub tid: Option<String>,
    /// Group object ids.
    pub groups: Vec<String>,
    /// When it was last set.
    pub updated_at: OffsetDateTime,
}

/// What happened to a cluster, as the change log records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeKind {
    /// The cluster was registered (created or imported).
    Created,
    /// The cluster was deleted: its identity is revoked, its tunnels must close.
    Deleted,
    /// Its tags changed.
    Tags,
    /// Its guard snapshot changed (a role or deny assignment was made or removed); the new version.
    Guard(u64),
    /// A renewal replaced its certificate: tunnels still up with the replaced one must close.
    Identity,
}

impl ChangeKind {
    /// The form stored in the log's `kind` column.
    fn as_db(self) -> &'static str {
        match self {
            ChangeKind::Created => "created",
            ChangeKind::Deleted => "deleted",
            ChangeKind::Tags => "tags",
            ChangeKind::Guard(_) => "guard",
            ChangeKind::Identity => "identity",
        }
    }

    /// The stored version of a guard change, if this is one.
    fn guard_version(self) -> Option<u64> {
        match self {
            ChangeKind::Guard(v) => Some(v),
            _ => None,
        }
    }

    /// Parses the stored form.
    fn from_db(kind: &str, guard_version: Option<u64>) -> Result<Self, StoreError> {
        match (kind, guard_version) {
            ("created", _) => Ok(ChangeKind::Created),
            ("deleted", _) => Ok(ChangeKind::Deleted),
            ("tags", _) => Ok(ChangeKind::Tags),
            ("guard", Some(v)) => Ok(ChangeKind::Guard(v)),
            ("identity", _) => Ok(ChangeKind::Identity),
            (other, v) => Err(StoreError::Corrupt(format!(
                "change kind {other:?} ({v:?})"
            ))),
        }
    }
}

/// One entry of the change log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterChange {
    /// Its position in the log: database-wide, gapless, in commit order.
    pub seq: u64,
    /// The cluster it is about.
    pub cluster: String,
    /// What happened.
    pub kind: ChangeKind,
    /// When (by the clock of the replica that made it).
    pub at: OffsetDateTime,
}

/// A page of the change log, read at one instant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChangePage {
    /// Entries after the cursor asked for, in order (at most the limit asked for).
    pub changes: Vec<ClusterChange>,
    /// The newest entry's sequence number at the time of the read (0 for an empty log).
    pub head: u64,
    /// True when the log no longer holds everything after the cursor (pruned, or the cursor is from another
    /// database): `changes` is empty and the reader must reload all state, then continue from `head`.
    pub reset: bool,
}

/// A relay replica's lease, as it registers or renews it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaLease {
    /// The replica's id (`--replica-id`).
    pub id: String,
    /// Where its peers reach its peer link (`--peer-address`), if it has one.
    pub peer_address: Option<String>,
    /// How long the lease lasts from now (by the database's clock).
    pub ttl: std::time::Duration,
    /// Whether the replica is draining (it takes no new tunnels; its agents are moving).
    pub draining: bool,
}

/// A replica as the store holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaRecord {
    /// Its id.
    pub id: String,
    /// Its peer link's address, if any.
    pub peer_address: Option<String>,
    /// When it registered (by the database's clock).
    pub started_at: OffsetDateTime,
    /// When its lease runs out unless renewed (by the database's clock).
    pub lease_expires: OffsetDateTime,
    /// Whether it is draining.
    pub draining: bool,
}

/// A tunnel a replica holds, as the store holds it (so that every replica can route to it and show it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TunnelRecord {
    /// The replica holding it.
    pub replica: String,
    /// Its id, unique within that replica's life.
    pub tunnel_id: u64,
    /// Its cluster.
    pub cluster: String,
    /// The agent process holding its other end (`hello.instance`; empty when not said).
    pub agent_instance: String,
    /// How many tunnels that agent process keeps (`hello.tunnels`; 0 when not said).
    pub agent_tunnels: u32,
    /// `wss` or `quic`.
    pub transport: String,
    /// The agent's address as the replica sees it.
    pub agent_address: String,
    /// Since when it is up.
    pub connected_since: OffsetDateTime,
    /// False once it got GOAWAY: it takes no new requests (its streams in flight go on).
    pub usable: bool,
}

/// A tunnel of a live replica, with what a peer needs to forward a request to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TunnelRoute {
    /// The tunnel.
    pub tunnel: TunnelRecord,
    /// The peer link address of the replica holding it, if it has one.
    pub peer_address: Option<String>,
    /// Whether that replica is draining.
    pub replica_draining: bool,
}

/// Wake-ups from a backend that pushes change notifications: each item means "the log may have grown".
/// Items carry no data; readers always re-read the log, so a lost or merged wake-up costs nothing but delay.
pub type ChangeSignals = BoxStream<'static, ()>;

/// Persistent relay state. Implementations must be safe to share between tasks; every method is one atomic
/// operation.
pub trait Store: Send + Sync + 'static {
    /// Registers a cluster; [`StoreError::AlreadyExists`] if the name is taken.
    fn create_cluster<'a>(&'a self, new: &'a NewCluster) -> StoreFuture<'a, ClusterRecord>;

    /// One cluster by name.
    fn cluster<'a>(&'a self, name: &'a str) -> StoreFuture<'a, Option<ClusterRecord>>;

    /// All clusters, ordered by name.
    fn list_clusters(&self) -> StoreFuture<'_, Vec<ClusterRecord>>;

    /// Removes a cluster and its identity; false if there was none.
    fn delete_cluster<'a>(&'a self, name: &'a str) -> StoreFuture<'a, bool>;

    /// The stored onboarding secrets of a cluster, `None` for an unknown cluster.
    fn secrets<'a>(&'a self, name: &'a str) -> StoreFuture<'a, Option<ClusterSecrets>>;

    /// Atomically marks the onboarding token used and stores the first identity, only if the cluster exists,
    /// its token hash equals `token` and it was not used yet. True when this call redeemed it.
    fn redeem_onboarding_token<'a>(
        &'a self,
        name: &'a str,
        token: &'a TokenHash,
        identity: &'a NewIdentity,
        at: OffsetDateTime,
    ) -> StoreFuture<'a, bool>;

    /// A renewal: `identity` becomes current and `presented` (the certificate the renewing agent is using)
    /// becomes the replaced one, refused from now on, only if the cluster exists and `presented` is its current
    /// fingerprint; logs a [`ChangeKind::Identity`] change in the same transaction, so every replica closes the
    /// tunnels still up with the replaced certificate. True when this call renewed it.
    fn renew_identity<'a>(
        &'a self,
        name: &'a str,
        presented: &'a str,
        identity: &'a NewIdentity,
    ) -> StoreFuture<'a, bool>;

    /// Records that the cluster's agent connected (sets connected-since, last-seen and agent version).
    fn record_connected<'a>(
        &'a self,
        name: &'a str,
        agent_version: &'a str,
        at: OffsetDateTime,
    ) -> StoreFuture<'a, ()>;

    /// Writes a batch of connectivity facts in one transaction. A last-seen time never moves backwards;
    /// unknown clusters are skipped.
    fn record_activity<'a>(&'a self, batch: &'a [Activity]) -> StoreFuture<'a, ()>;

    /// Stores the metadata (and the agent version it carries) the cluster's agent reported.
    fn record_metadata<'a>(
        &'a self,
        name: &'a str,
        metadata: &'a ClusterMetadata,
        agent_version: &'a str,
    ) -> StoreFuture<'a, ()>;

    /// Records that the cluster's agent disconnected (clears connected-since; last-seen stays the last time
    /// the agent was heard from).
    fn record_disconnected<'a>(&'a self, name: &'a str) -> StoreFuture<'a, ()>;

    /// Stores a custom role definition. [`StoreError::Conflict`] when a role (custom or built-in) with the same
    /// id or name, ignoring ASCII case, exists.
    fn create_role_definition<'a>(
        &'a self,
        role: &'a RoleDefinition,
        at: OffsetDateTime,
    ) -> StoreFuture<'a, ()>;

    /// The custom role definitions, by id.
    fn role_definitions(&self) -> StoreFuture<'_, Vec<RoleDefinition>>;

    /// Removes the custom role with this id (ignoring ASCII case); false if there is none (built-ins are never
    /// removed). [`StoreError::Conflict`] while an assignment uses it.
    fn delete_role_definition<'a>(&'a self, id: &'a str) -> StoreFuture<'a, bool>;

    /// Stores a role assignment and raises its cluster's snapshot version, in one transaction; returns the new
    /// version. [`StoreError::NotFound`] for an unknown cluster or role, [`StoreError::Conflict`] for a
    /// duplicate (same role, principal, cluster and namespace).
    fn create_role_assignment<'a>(
        &'a self,
        assignment: &'a RoleAssignmentRecord,
    ) -> StoreFuture<'a, u64>;

    /// Role assignments, of one cluster or all, ordered by cluster then id.
    fn role_assignments<'a>(
        &'a self,
        cluster: Option<&'a str>,
    ) -> StoreFuture<'a, Vec<RoleAssignmentRecord>>;

    /// Removes a role assignment and raises its cluster's snapshot version; returns the cluster and the new
    /// version, `None` if there was no such assignment.
    fn delete_role_assignment<'a>(&'a self, id: &'a str) -> StoreFuture<'a, Option<(String, u64)>>;

    /// Stores a deny assignment and raises its cluster's snapshot version; returns the new version.
    /// [`StoreError::NotFound`] for an unknown cluster.
    fn create_deny_assignment<'a>(&'a self, deny: &'a DenyAssignmentRecord)
    -> StoreFuture<'a, u64>;

    /// Deny assignments, of one cluster or all, ordered by cluster then id.
    fn deny_assignments<'a>(
        &'a self,
        cluster: Option<&'a str>,
    ) -> StoreFuture<'a, Vec<DenyAssignmentRecord>>;

    /// Removes a deny assignment and raises its cluster's snapshot version; returns the cluster and the new
    /// version, `None` if there was no such deny assignment.
    fn delete_deny_assignment<'a>(&'a self, id: &'a str) -> StoreFuture<'a, Option<(String, u64)>>;

    /// A consistent read of what the cluster's guard snapshot holds; `None` for an unknown cluster.
    fn guard_state<'a>(&'a self, cluster: &'a str) -> StoreFuture<'a, Option<GuardState>>;

    /// Registers a cluster together with its assignments, in one transaction (import). `roles` are custom
    /// roles the assignments need: each is created unless a role with its id exists (the caller has checked
    /// that an existing one is the same). [`StoreError::AlreadyExists`] if the name is taken.
    fn import_cluster<'a>(
        &'a self,
        new: &'a NewCluster,
        roles: &'a [RoleDefinition],
        assignments: &'a [RoleAssignmentRecord],
        denies: &'a [DenyAssignmentRecord],
    ) -> StoreFuture<'a, ClusterRecord>;

    /// Sets (replaces) a user's groups in the directory.
    fn set_directory_entry<'a>(&'a self, entry: &'a DirectoryEntry) -> StoreFuture<'a, ()>;

    /// A user's directory entry.
    fn directory_entry<'a>(&'a self, oid: &'a str) -> StoreFuture<'a, Option<DirectoryEntry>>;

    /// Removes a user from the directory; false if there was no entry.
    fn delete_directory_entry<'a>(&'a self, oid: &'a str) -> StoreFuture<'a, bool>;

    /// Replaces a cluster's tags (and logs a [`ChangeKind::Tags`] change); false for an unknown cluster.
    fn set_cluster_tags<'a>(
        &'a self,
        name: &'a str,
        tags: &'a BTreeMap<String, String>,
    ) -> StoreFuture<'a, bool>;

    /// The change log after `after` (at most `limit` entries), with the log's head; see [`ChangePage`].
    fn changes_since(&self, after: u64, limit: u32) -> StoreFuture<'_, ChangePage>;

    /// Removes the log entries made before `before` (each replica re-reads the log every few seconds, so an
    /// hour of history is plenty); returns how many were removed. A reader whose cursor falls in the removed
    /// part gets [`ChangePage::reset`].
    fn prune_changes(&self, before: OffsetDateTime) -> StoreFuture<'_, u64>;

    /// Push notifications of log growth, when the backend has them (PostgreSQL `LISTEN`; SQLite: changes made
    /// through this same handle). `None`: poll [`Store::changes_since`] only.
    fn change_signals(&self) -> StoreFuture<'_, Option<ChangeSignals>>;

    /// Registers replica `lease.id` (again, after a restart with the same id: it then holds no tunnel) with a
    /// lease of `lease.ttl` from now.
    fn register_replica<'a>(&'a self, lease: &'a ReplicaLease) -> StoreFuture<'a, ()>;

    /// Renews the replica's lease for `lease.ttl` from now and records whether it drains; false when its row is
    /// gone (its lease lapsed and a peer removed it): register again and put its tunnels back.
    fn renew_lease<'a>(&'a self, lease: &'a ReplicaLease) -> StoreFuture<'a, bool>;

    /// Removes the replica and the tunnels it held (at exit).
    fn remove_replica<'a>(&'a self, id: &'a str) -> StoreFuture<'a, ()>;

    /// Removes the replicas whose lease ran out more than `expired_for` ago, with their tunnels; how many.
    fn reap_replicas(&self, expired_for: std::time::Duration) -> StoreFuture<'_, u64>;

    /// The replicas whose lease runs, by id.
    fn live_replicas(&self) -> StoreFuture<'_, Vec<ReplicaRecord>>;

    /// Records a tunnel its replica holds, or updates it (agent instance and K, usable). [`StoreError::NotFound`]
    /// when its cluster or its replica is gone.
    fn put_tunnel<'a>(&'a self, tunnel: &'a TunnelRecord) -> StoreFuture<'a, ()>;

    /// Forgets a tunnel (it closed).
    fn remove_tunnel<'a>(&'a self, replica: &'a str, tunnel_id: u64) -> StoreFuture<'a, ()>;

    /// The tunnels of live replicas (lease running), of one cluster or all, by cluster, replica and tunnel id.
    fn tunnel_routes<'a>(&'a self, cluster: Option<&'a str>) -> StoreFuture<'a, Vec<TunnelRoute>>;

    /// Which backend this is (SQLite serves one relay process; PostgreSQL a fleet).
    fn backend(&self) -> Backend;

    /// Flushes and closes the backend.
    fn close(&self) -> StoreFuture<'_, ()>;
}

/// The snapshot version a change at `at` gives a cluster whose version was `previous`: strictly greater, and
/// at least `at` in Unix milliseconds, so versions also grow across a delete and re-registration or an import
/// elsewhere (guard keeps the last snapshot on disk and takes only newer ones).
pub fn next_guard_version(previous: u64, at: OffsetDateTime) -> u64 {
    let floor = u64::try_from(at.unix_timestamp_nanos() / 1_000_000).unwrap_or(0);
    previous.saturating_add(1).max(floor)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backends_by_scheme() {
        for url in [
            "sqlite::memory:",
            "sqlite:///var/lib/tether/relay.db",
            "sqlite:relay.db",
            "SQLITE:x",
        ] {
            assert_eq!(Backend::of_url(url).expect(url), Backend::Sqlite, "{url}");
        }
        for url in [
            "postgres://db/tether",
            "postgresql://u:p@db:5432/tether?sslmode=verify-full",
        ] {
            assert_eq!(Backend::of_url(url).expect(url), Backend::Postgres, "{url}");
        }
        for url in [
            "mysql://u:hunter2@db/tether",
            "postgres:db",
            "",
            "relay.db",
            "http://x",
        ] {
            let err = Backend::of_url(url).expect_err(url);
            assert!(matches!(err, StoreError::UnsupportedUrl(_)), "{url}");
            assert!(!err.to_string().contains("hunter2"), "{err}");
        }
        assert_eq!(
            redact_url("postgres://relay:s3cret@db:5432/tether"),
            "postgres://relay:***@db:5432/tether"
        );
        assert_eq!(redact_url("postgres://db/x"), "postgres://db/x");
    }

    #[tokio::test]
    async fn open_picks_the_backend_and_refuses_others() {
        let store = open("sqlite::memory:").await.expect("sqlite opens");
        assert!(store.list_clusters().await.expect("list").is_empty());
        assert!(matches!(
            open("mysql://root:pw@127.0.0.1/x").await,
            Err(StoreError::UnsupportedUrl(u)) if u == "mysql://root:***@127.0.0.1/x"
        ));
    }

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

    #[test]
    fn guard_versions_grow_and_follow_the_clock() {
        let t = OffsetDateTime::from_unix_timestamp(1_700_000_000).expect("valid");
        assert_eq!(next_guard_version(0, t), 1_700_000_000_000);
        assert_eq!(next_guard_version(1_700_000_000_000, t), 1_700_000_000_001);
        // A clock that went back does not make a version go back.
        assert_eq!(next_guard_version(1_800_000_000_000, t), 1_800_000_000_001);
        assert_eq!(next_guard_version(u64::MAX, t), u64::MAX);
    }
}

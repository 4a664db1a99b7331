//! [`Guard`]: authentication and authorization with cache, metrics and audit around the pure functions. This is
//! what the HTTPS server calls, and what an in-process user (the relay, the agent's proxy, `tether up`) can call
//! directly.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

use crate::audit::{AuditRecord, AuditSink};
use crate::cache::{CacheKey, DecisionCache, hash_groups};
use crate::metrics::Metrics;
use crate::snapshot::SnapshotStore;
use tether_auth::rbac::{self, AccessRequest, Decision};
use tether_auth::token::{Authenticator, Identity, TokenError};

/// Settings of a [`Guard`] beyond its parts.
#[derive(Clone, Debug)]
pub struct GuardOptions {
    /// How long a decision is cached (zero: no cache). Any new snapshot version empties the cache anyway.
    pub cache_ttl: Duration,
    /// Most decisions cached.
    pub cache_max_entries: usize,
    /// Where audit lines go.
    pub audit: AuditSink,
}

impl Default for GuardOptions {
    fn default() -> Self {
        Self {
            cache_ttl: Duration::from_secs(60),
            cache_max_entries: 100_000,
            audit: AuditSink::Off,
        }
    }
}

/// The decision engine. Share it behind an `Arc`.
#[derive(Debug)]
pub struct Guard {
    authenticator: Option<Arc<Authenticator>>,
    store: Arc<SnapshotStore>,
    cache: DecisionCache,
    metrics: Metrics,
    audit: AuditSink,
}

/// A fresh request id: 16 hex characters.
pub fn new_request_id() -> String {
    let mut bytes = [0u8; 8];
    rand::fill(&mut bytes);
    hex::encode(bytes)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

impl Guard {
    /// A guard deciding from `store`; without an authenticator, `/authenticate` refuses every token.
    pub fn new(
        authenticator: Option<Arc<Authenticator>>,
        store: Arc<SnapshotStore>,
        options: GuardOptions,
    ) -> Self {
        let metrics = Metrics::new();
        metrics
            .snapshot_version
            .set(i64::try_from(store.version()).unwrap_or(i64::MAX));
        Self {
            authenticator,
            store,
            cache: DecisionCache::new(options.cache_ttl, options.cache_max_entries),
            metrics,
            audit: options.audit,
        }
    }

    /// The snapshot store (to push updates into).
    pub fn store(&self) -> &Arc<SnapshotStore> {
        &self.store
    }

    /// The authenticator, if configured.
    pub fn authenticator(&self) -> Option<&Arc<Authenticator>> {
        self.authenticator.as_ref()
    }

    /// The metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The decision cache.
    pub fn cache(&self) -> &DecisionCache {
        &self.cache
    }

    /// Validates a bearer token; counts and audits the outcome (never the token).
    pub async fn authenticate(
        &self,
        token: &str,
        request_id: &str,
    ) -> Result<Identity, TokenError> {
        let started = Instant::now();
        let result = match &self.authenticator {
            Some(a) => a.authenticate(token).await,
            None => Err(TokenError::KeysUnavailable(
                "guard has no token configuration".to_owned(),
            )),
        };
        let elapsed = started.elapsed();
        self.metrics.observe("authenticate", elapsed.as_secs_f64());
        let (decision, reason, oid, groups_hash) = match &result {
            Ok(id) => {
                self.metrics.decision("authenticate", "authenticated");
                let mut groups = id.groups.clone();
                groups.sort();
                groups.dedup();
                (
                    "authenticated",
                    format!("{:?} token", id.kind),
                    Some(id.uid.clone()),
                    Some(hash_groups(&groups)),
                )
            }
            Err(e) => {
                self.metrics.decision("authenticate", "unauthenticated");
                self.metrics
                    .token_refusals
                    .get_or_create(&crate::metrics::RefusalLabels { reason: e.label() })
                    .inc();
                ("unauthenticated", e.to_string(), None, None)
            }
        };
        self.audit.record(&AuditRecord {
            ts_ms: now_ms(),
            request_id: request_id.to_owned(),
            webhook: "authenticate",
            oid,
            groups_hash,
            actions: Vec::new(),
            scope: None,
            decision,
            reason,
            source: "token",
            latency_us: micros(elapsed),
        });
        result
    }

    /// Decides an access request against the current snapshot, through the cache; counts and audits it.
    pub fn authorize(&self, request: &AccessRequest, request_id: &str) -> Decision {
        let started = Instant::now();
        let snapshot = self.store.current();
        self.metrics
            .snapshot_version
            .set(i64::try_from(snapshot.version).unwrap_or(i64::MAX));
        let (decision, source, prepared) = match rbac::prepare(request) {
            Err(d) => (d, "evaluation", None),
            Ok(p) => {
                let key = CacheKey::new(&p);
                match self.cache.get(snapshot.version, &key) {
                    Some(d) => (d, "cache", Some(p)),
                    None => {
                        let d = rbac::evaluate(&snapshot, &p);
                        self.cache.insert(snapshot.version, key, d.clone());
                        (d, "evaluation", Some(p))
                    }
                }
            }
        };
        let elapsed = started.elapsed();
        self.metrics.source(source);
        self.metrics.decision("authorize", decision.label());
        self.metrics.observe("authorize", elapsed.as_secs_f64());
        let oid = prepared
            .as_ref()
            .map(|p| p.principal.oid.clone())
            .or_else(|| {
                request
                    .extra
                    .get(tether_auth::token::EXTRA_OID)
                    .and_then(|v| v.first().cloned())
            });
        self.audit.record(&AuditRecord {
            ts_ms: now_ms(),
            request_id: request_id.to_owned(),
            webhook: "authorize",
            oid,
            groups_hash: prepared.as_ref().map(|p| hash_groups(&p.principal.groups)),
            actions: prepared
                .as_ref()
                .map(|p| p.actions.clone())
                .unwrap_or_default(),
            scope: prepared.as_ref().map(|p| match &p.namespace {
                Some(ns) => format!("namespace/{ns}"),
                None => "cluster".to_owned(),
            }),
            decision: decision.label(),
            reason: decision.reason.clone(),
            source,
            latency_us: micros(elapsed),
        });
        decision
    }

    /// Counts and audits a request that could not be answered (bad body, unauthenticated caller).
    pub fn record_error(&self, webhook: &'static str, request_id: &str, reason: &str) {
        self.metrics.decision(webhook, "error");
        if webhook == "authorize" {
            self.metrics.source("error");
        }
        self.audit.record(&AuditRecord {
            ts_ms: now_ms(),
            request_id: request_id.to_owned(),
            webhook,
            oid: None,
            groups_hash: None,
            actions: Vec::new(),
            scope: None,
            decision: "error",
            reason: reason.to_owned(),
            source: "error",
            latency_us: 0,
        });
    }
}

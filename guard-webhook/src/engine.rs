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
    /// What guard protects whatever the snapshot says (the agent's namespace).
    pub protection: rbac::Protection,
    /// The groups prefix of the identities guard authorizes (the token configuration's `groups_prefix`):
    /// removed before matching assignments; groups without it are ignored. Empty: groups as they are.
    pub groups_prefix: String,
}

impl Default for GuardOptions {
    fn default() -> Self {
        Self {
            cache_ttl: Duration::from_secs(60),
            cache_max_entries: 100_000,
            audit: AuditSink::Off,
            protection: rbac::Protection::default(),
            groups_prefix: String::new(),
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
    protection: rbac::Protection,
    groups_prefix: String,
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
            protection: options.protection,
            groups_prefix: options.groups_prefix,
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
        // The agent's own identity impersonating a system: name or a service account is denied first.
        let prepared = match rbac::agent_impersonation(request, &self.protection) {
            Some(denied) => Err(denied),
            None => rbac::prepare_with_prefix(request, &self.groups_prefix),
        };
        let (decision, source, prepared) = match prepared {
            Err(d) => (d, "evaluation", None),
            Ok(p) => {
                let key = CacheKey::new(&p);
                match self.cache.get(snapshot.version, &key) {
                    Some(d) => (d, "cache", Some(p)),
                    None => {
                        let d = rbac::evaluate_protected(&snapshot, &p, &self.protection);
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use tether_auth::rbac::{
        DenyAssignment, EVERYONE, Protection, ResourceAttributes, RoleAssignment, Scope, Snapshot,
    };

    const WRITER: &str = "5b999177-9696-4545-85c7-50de3797e5a1";

    fn request(verb: &str, resource: &str, ns: &str) -> AccessRequest {
        AccessRequest {
            user: "alice@x".to_owned(),
            extra: BTreeMap::from([("oid".to_owned(), vec!["alice".to_owned()])]),
            resource: Some(ResourceAttributes {
                namespace: ns.to_owned(),
                verb: verb.to_owned(),
                resource: resource.to_owned(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn guard(protection: Protection) -> Guard {
        let snapshot = Snapshot {
            version: 1,
            assignments: vec![RoleAssignment {
                id: "w".to_owned(),
                role_id: WRITER.to_owned(),
                principal_id: "alice".to_owned(),
                scope: Scope::Cluster,
            }],
            deny_assignments: vec![DenyAssignment {
                id: "d".to_owned(),
                name: "no prod secrets".to_owned(),
                data_actions: vec!["Microsoft.Kubernetes/connectedClusters/secrets/*".to_owned()],
                not_data_actions: vec![],
                principals: vec![EVERYONE.to_owned()],
                exclude_principals: vec![],
                scope: Scope::Namespace("prod".to_owned()),
            }],
            ..Default::default()
        };
        Guard::new(
            None,
            Arc::new(SnapshotStore::in_memory(snapshot)),
            GuardOptions {
                protection,
                ..GuardOptions::default()
            },
        )
    }

    #[test]
    fn a_cached_cluster_level_get_does_not_answer_a_list_across_namespaces() {
        // `get` and `list` of secrets without a namespace need the same data action; only the list reaches into
        // prod, so the cache must not hand the get's "allowed" to it.
        let g = guard(Protection::default());
        assert!(g.authorize(&request("get", "secrets", ""), "r1").allowed);
        let d = g.authorize(&request("list", "secrets", ""), "r2");
        assert_eq!((d.allowed, d.denied), (false, true), "{d:?}");
        let d = g.authorize(&request("list", "secrets", ""), "r3");
        assert!(d.denied, "and from the cache: {d:?}");
    }

    #[test]
    fn guard_applies_its_agent_protection() {
        let g = guard(Protection {
            agent_namespace: Some("tether-system".to_owned()),
        });
        assert!(
            g.authorize(&request("get", "secrets", "tether-system"), "r1")
                .denied
        );
        assert!(g.authorize(&request("get", "secrets", "dev"), "r2").allowed);
        let g = guard(Protection::default());
        assert!(
            g.authorize(&request("get", "secrets", "tether-system"), "r3")
                .allowed
        );
    }
}

//! The decision cache: keyed by (object id, hash of the sorted group set, data actions, namespace) — never by
//! username — with a TTL, and emptied whenever the snapshot version changes, so a removed assignment stops
//! working as soon as the new snapshot arrives.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::time::Instant;

use tether_auth::rbac::{Decision, Prepared};

/// A stable, short hash of a group set (sorted, de-duplicated), for cache keys and audit lines.
pub fn hash_groups(sorted_groups: &[String]) -> String {
    let mut h = Sha256::new();
    for g in sorted_groups {
        h.update(g.as_bytes());
        h.update([0u8]);
    }
    hex::encode(&h.finalize()[..12])
}

/// A cache key.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CacheKey {
    oid: String,
    groups_hash: String,
    actions: Vec<String>,
    namespace: Option<String>,
    spans_namespaces: bool,
}

impl CacheKey {
    /// The key of a prepared request.
    pub fn new(req: &Prepared) -> Self {
        Self {
            oid: req.principal.oid.clone(),
            groups_hash: hash_groups(&req.principal.groups),
            actions: req.actions.clone(),
            namespace: req.namespace.clone(),
            spans_namespaces: req.spans_namespaces,
        }
    }
}

struct Inner {
    version: u64,
    entries: HashMap<CacheKey, (Decision, Instant)>,
}

/// Decisions by [`CacheKey`], valid for one snapshot version and at most `ttl`.
pub struct DecisionCache {
    ttl: Duration,
    max_entries: usize,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for DecisionCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecisionCache")
            .field("ttl", &self.ttl)
            .field("len", &self.len())
            .finish()
    }
}

impl DecisionCache {
    /// A cache keeping decisions for `ttl`, holding at most `max_entries` (a full cache drops expired entries,
    /// then everything). A zero `ttl` disables caching.
    pub fn new(ttl: Duration, max_entries: usize) -> Self {
        Self {
            ttl,
            max_entries: max_entries.max(1),
            inner: Mutex::new(Inner {
                version: 0,
                entries: HashMap::new(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The cached decision for `key` under snapshot `version`, if fresh.
    pub fn get(&self, version: u64, key: &CacheKey) -> Option<Decision> {
        if self.ttl.is_zero() {
            return None;
        }
        let mut inner = self.lock();
        if inner.version != version {
            inner.entries.clear();
            inner.version = version;
            return None;
        }
        let now = Instant::now();
        match inner.entries.get(key) {
            Some((d, at)) if now.duration_since(*at) < self.ttl => Some(d.clone()),
            Some(_) => {
                inner.entries.remove(key);
                None
            }
            None => None,
        }
    }

    /// Stores a decision made under snapshot `version`.
    pub fn insert(&self, version: u64, key: CacheKey, decision: Decision) {
        if self.ttl.is_zero() {
            return;
        }
        let mut inner = self.lock();
        if inner.version != version {
            if version < inner.version {
                return; // Made under an older snapshot: never cache it.
            }
            inner.entries.clear();
            inner.version = version;
        }
        let now = Instant::now();
        if inner.entries.len() >= self.max_entries {
            let ttl = self.ttl;
            inner
                .entries
                .retain(|_, (_, at)| now.duration_since(*at) < ttl);
            if inner.entries.len() >= self.max_entries {
                inner.entries.clear();
            }
        }
        inner.entries.insert(key, (decision, now));
    }

    /// Drops everything.
    pub fn clear(&self) {
        self.lock().entries.clear();
    }

    /// Number of entries held.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_auth::rbac::Principal;

    fn prepared(oid: &str, groups: &[&str], ns: Option<&str>) -> Prepared {
        Prepared {
            principal: Principal {
                oid: oid.to_owned(),
                groups: groups.iter().map(|g| (*g).to_owned()).collect(),
            },
            actions: vec!["a/read".to_owned()],
            namespace: ns.map(str::to_owned),
            spans_namespaces: false,
        }
    }

    fn allow() -> Decision {
        Decision {
            allowed: true,
            denied: false,
            reason: "ok".to_owned(),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn ttl_version_and_key_parts() {
        let cache = DecisionCache::new(Duration::from_secs(10), 100);
        let k = CacheKey::new(&prepared("o", &["g1", "g2"], Some("dev")));
        cache.insert(1, k.clone(), allow());
        assert_eq!(cache.get(1, &k), Some(allow()));
        // Any key part changes the key.
        assert_eq!(
            cache.get(1, &CacheKey::new(&prepared("o", &["g1"], Some("dev")))),
            None
        );
        assert_eq!(
            cache.get(
                1,
                &CacheKey::new(&prepared("o2", &["g1", "g2"], Some("dev")))
            ),
            None
        );
        assert_eq!(
            cache.get(1, &CacheKey::new(&prepared("o", &["g1", "g2"], None))),
            None
        );
        tokio::time::advance(Duration::from_secs(11)).await;
        assert_eq!(cache.get(1, &k), None, "expired");
        cache.insert(1, k.clone(), allow());
        assert_eq!(
            cache.get(2, &k),
            None,
            "a new snapshot version empties the cache"
        );
        assert!(cache.is_empty());
        cache.insert(1, k.clone(), allow());
        assert!(
            cache.is_empty(),
            "decisions from an older snapshot are not cached"
        );
    }

    #[test]
    fn bounded() {
        let cache = DecisionCache::new(Duration::from_secs(10), 3);
        for i in 0..10 {
            cache.insert(
                1,
                CacheKey::new(&prepared(&format!("o{i}"), &[], None)),
                allow(),
            );
            assert!(cache.len() <= 3);
        }
        assert_ne!(
            hash_groups(&["a".to_owned(), "b".to_owned()]),
            hash_groups(&["ab".to_owned()])
        );
    }
}

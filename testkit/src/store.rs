//! The object store: every object under one lock, one global monotonically increasing resourceVersion, a
//! bounded history of change events for watches that resume, and a broadcast channel for live watches.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Bound;
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::{Value, json};
use tokio::sync::broadcast;

use crate::resources::Resource;
use crate::status::ApiError;
use crate::util;

/// How many change events are kept for watches that resume from an older resourceVersion.
const HISTORY: usize = 20_000;
/// How many live events a slow watcher may fall behind before it catches up from the history.
const BROADCAST: usize = 1024;

/// Where an object lives: resource, namespace ("" for cluster-scoped), name. Ordered as etcd keys are.
pub(crate) type Key = (Resource, String, String);

/// The type of a watch event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One change, as watches see it.
#[derive(Debug)]
pub(crate) struct Event {
    pub(crate) kind: EventType,
    pub(crate) resource: Resource,
    pub(crate) namespace: String,
    /// The object after the change (for DELETED, the last state with the deletion's resourceVersion).
    pub(crate) object: Value,
    /// The object before the change, for MODIFIED (lets selector watches turn it into ADDED or DELETED).
    pub(crate) prev: Option<Value>,
    pub(crate) rv: u64,
}

/// The result of a LIST.
#[derive(Debug)]
pub(crate) struct ListResult {
    pub(crate) items: Vec<Value>,
    pub(crate) rv: u64,
    /// Where the next page starts (after this namespace/name), when more matching items exist.
    pub(crate) next: Option<(String, String)>,
    pub(crate) remaining: usize,
}

/// What a new watch starts from.
pub(crate) struct WatchStart {
    pub(crate) initial: Vec<Arc<Event>>,
    /// The store's resourceVersion when the watch started: live events all come after it.
    pub(crate) rv: u64,
    pub(crate) live: broadcast::Receiver<Arc<Event>>,
}

struct Inner {
    rv: u64,
    objects: BTreeMap<Key, Value>,
    history: VecDeque<Arc<Event>>,
    /// Every event with a resourceVersion above this is still in `history`.
    floor: u64,
}

/// The object store.
pub(crate) struct Store {
    inner: Mutex<Inner>,
    tx: broadcast::Sender<Arc<Event>>,
    /// The custom kinds this store serves (ids in [`crate::custom`]'s registry).
    custom: Mutex<Vec<u32>>,
}

impl Store {
    pub(crate) fn new() -> Store {
        let (tx, _) = broadcast::channel(BROADCAST);
        Store {
            inner: Mutex::new(Inner {
                rv: 1,
                objects: BTreeMap::new(),
                history: VecDeque::new(),
                floor: 1,
            }),
            tx,
            custom: Mutex::new(Vec::new()),
        }
    }

    /// The ids of the custom kinds served.
    pub(crate) fn custom_ids(&self) -> Vec<u32> {
        self.custom.lock().map(|c| c.clone()).unwrap_or_default()
    }

    /// Serves custom kind `id`.
    pub(crate) fn add_custom_id(&self, id: u32) {
        if let Ok(mut c) = self.custom.lock() {
            c.push(id);
        }
    }

    /// Stops serving custom kind `id`.
    pub(crate) fn remove_custom_id(&self, id: u32) {
        if let Ok(mut c) = self.custom.lock() {
            c.retain(|x| *x != id);
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave a half-written object: every write is one insert/remove.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn current_rv(&self) -> u64 {
        self.lock().rv
    }

    pub(crate) fn get(
        &self,
        resource: Resource,
        namespace: &str,
        name: &str,
    ) -> Result<Value, ApiError> {
        let inner = self.lock();
        inner
            .objects
            .get(&(resource, namespace.to_string(), name.to_string()))
            .cloned()
            .ok_or_else(|| ApiError::not_found(resource.plural(), name))
    }

    pub(crate) fn exists(&self, resource: Resource, namespace: &str, name: &str) -> bool {
        self.lock()
            .objects
            .contains_key(&(resource, namespace.to_string(), name.to_string()))
    }

    /// Objects of `resource` (in `namespace` if given) that pass `filter`, in key order, starting after `after`,
    /// at most `limit` of them.
    pub(crate) fn list(
        &self,
        resource: Resource,
        namespace: Option<&str>,
        filter: &dyn Fn(&Value) -> bool,
        limit: Option<usize>,
        after: Option<(String, String)>,
    ) -> ListResult {
        let inner = self.lock();
        let start = match after {
            Some((ns, name)) => Bound::Excluded((resource, ns, name)),
            None => Bound::Included((
                resource,
                namespace.unwrap_or_default().to_string(),
                String::new(),
            )),
        };
        let mut items = Vec::new();
        let mut next = None;
        let mut remaining = 0;
        let in_scope = |k: &Key| k.0 == resource && namespace.is_none_or(|ns| k.1 == ns);
        for (key, obj) in inner
            .objects
            .range((start, Bound::Unbounded))
            .take_while(|(k, _)| in_scope(k))
        {
            if !filter(obj) {
                continue;
            }
            if limit.is_some_and(|l| items.len() >= l) {
                remaining += 1;
                continue;
            }
            items.push(obj.clone());
            next = Some((key.1.clone(), key.2.clone()));
        }
        if remaining == 0 {
            next = None;
        }
        ListResult {
            items,
            rv: inner.rv,
            next,
            remaining,
        }
    }

    /// Stores a new object (name already set and validated). Sets uid, creationTimestamp, resourceVersion.
    pub(crate) fn create(
        &self,
        resource: Resource,
        mut obj: Value,
        dry_run: bool,
    ) -> Result<Value, ApiError> {
        let name = obj["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let namespace = obj["metadata"]["namespace"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let mut inner = self.lock();
        if resource.namespaced()
            && !inner.objects.contains_key(&(
                Resource::Namespaces,
                String::new(),
                namespace.clone(),
            ))
        {
            return Err(ApiError::not_found("namespaces", &namespace));
        }
        let key = (resource, namespace.clone(), name.clone());
        if inner.objects.contains_key(&key) {
            return Err(ApiError::already_exists(resource.plural(), &name));
        }
        let rv = inner.rv + 1;
        if let Some(meta) = obj["metadata"].as_object_mut() {
            meta.insert("uid".into(), json!(util::uid()));
            meta.insert(
                "creationTimestamp".into(),
                json!(util::timestamp(time::OffsetDateTime::now_utc())),
            );
            meta.insert("resourceVersion".into(), json!(rv.to_string()));
        }
        if dry_run {
            return Ok(obj);
        }
        inner.rv = rv;
        inner.objects.insert(key, obj.clone());
        self.record(
            &mut inner,
            EventType::Added,
            resource,
            namespace,
            obj.clone(),
            None,
        );
        Ok(obj)
    }

    /// Replaces an object with what `change` makes of the current one. The result keeps identity fields; a
    /// non-empty `metadata.resourceVersion` in it must match the current one (409 Conflict otherwise). A change that
    /// alters nothing is not written and does not bump the resourceVersion, as in kube-apiserver.
    pub(crate) fn update(
        &self,
        resource: Resource,
        namespace: &str,
        name: &str,
        dry_run: bool,
        change: impl FnOnce(&Value) -> Result<Value, ApiError>,
    ) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        let key = (resource, namespace.to_string(), name.to_string());
        let current = inner
            .objects
            .get(&key)
            .cloned()
            .ok_or_else(|| ApiError::not_found(resource.plural(), name))?;
        let mut next = change(&current)?;
        let wanted_rv = next["metadata"]["resourceVersion"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if !wanted_rv.is_empty()
            && wanted_rv
                != current["metadata"]["resourceVersion"]
                    .as_str()
                    .unwrap_or_default()
        {
            return Err(ApiError::conflict(resource.plural(), name));
        }
        if let (Some(meta), Some(cur)) = (
            next["metadata"].as_object_mut(),
            current["metadata"].as_object(),
        ) {
            for field in [
                "name",
                "namespace",
                "uid",
                "creationTimestamp",
                "resourceVersion",
            ] {
                match cur.get(field) {
                    Some(v) => meta.insert(field.into(), v.clone()),
                    None => meta.remove(field),
                };
            }
        }
        if next == current {
            return Ok(current);
        }
        let rv = inner.rv + 1;
        if let Some(meta) = next["metadata"].as_object_mut() {
            meta.insert("resourceVersion".into(), json!(rv.to_string()));
        }
        if dry_run {
            return Ok(next);
        }
        inner.rv = rv;
        inner.objects.insert(key, next.clone());
        self.record(
            &mut inner,
            EventType::Modified,
            resource,
            namespace.to_string(),
            next.clone(),
            Some(current),
        );
        Ok(next)
    }

    /// Removes an object after `check` accepts it (preconditions); deleting a namespace removes what is in it.
    pub(crate) fn delete(
        &self,
        resource: Resource,
        namespace: &str,
        name: &str,
        dry_run: bool,
        check: impl FnOnce(&Value) -> Result<(), ApiError>,
    ) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        let key = (resource, namespace.to_string(), name.to_string());
        let current = inner
            .objects
            .get(&key)
            .ok_or_else(|| ApiError::not_found(resource.plural(), name))?;
        check(current)?;
        if dry_run {
            return Ok(current.clone());
        }
        if resource == Resource::Namespaces {
            let contained: Vec<Key> = inner
                .objects
                .keys()
                .filter(|k| k.0.namespaced() && k.1 == name)
                .cloned()
                .collect();
            for k in contained {
                self.remove(&mut inner, &k);
            }
        }
        self.remove(&mut inner, &key)
            .ok_or_else(|| ApiError::not_found(resource.plural(), name))
    }

    fn remove(&self, inner: &mut Inner, key: &Key) -> Option<Value> {
        let mut obj = inner.objects.remove(key)?;
        inner.rv += 1;
        if let Some(meta) = obj["metadata"].as_object_mut() {
            meta.insert("resourceVersion".into(), json!(inner.rv.to_string()));
        }
        self.record(
            inner,
            EventType::Deleted,
            key.0,
            key.1.clone(),
            obj.clone(),
            None,
        );
        Some(obj)
    }

    fn record(
        &self,
        inner: &mut Inner,
        kind: EventType,
        resource: Resource,
        namespace: String,
        object: Value,
        prev: Option<Value>,
    ) {
        let event = Arc::new(Event {
            kind,
            resource,
            namespace,
            object,
            prev,
            rv: inner.rv,
        });
        inner.history.push_back(event.clone());
        while inner.history.len() > HISTORY {
            if let Some(old) = inner.history.pop_front() {
                inner.floor = old.rv;
            }
        }
        // No receivers is fine: nobody is watching.
        let _ = self.tx.send(event);
    }

    /// Starts a watch on `resource` (in `namespace` if given). `since` None: synthetic ADDED events for what exists
    /// now; `since` Some(rv): every change after rv, or 410 Gone if the history no longer reaches back that far.
    pub(crate) fn watch(
        &self,
        resource: Resource,
        namespace: Option<&str>,
        since: Option<u64>,
    ) -> Result<WatchStart, ApiError> {
        let inner = self.lock();
        // Subscribing under the lock: no event can fall between the initial set and the live stream.
        let live = self.tx.subscribe();
        let in_scope = |r: Resource, ns: &str| r == resource && namespace.is_none_or(|n| n == ns);
        let initial = match since {
            None => inner
                .objects
                .iter()
                .filter(|(k, _)| in_scope(k.0, &k.1))
                .map(|(k, obj)| {
                    let rv = obj["metadata"]["resourceVersion"]
                        .as_str()
                        .and_then(|s| s.parse().ok())
                        .unwrap_or(0);
                    Arc::new(Event {
                        kind: EventType::Added,
                        resource: k.0,
                        namespace: k.1.clone(),
                        object: obj.clone(),
                        prev: None,
                        rv,
                    })
                })
                .collect(),
            Some(rv) => Self::history_since(&inner, rv)?
                .into_iter()
                .filter(|e| in_scope(e.resource, &e.namespace))
                .collect(),
        };
        Ok(WatchStart {
            initial,
            rv: inner.rv,
            live,
        })
    }

    /// Every change after `rv` (410 Gone if too old); how a lagging watcher catches up.
    pub(crate) fn events_since(&self, rv: u64) -> Result<Vec<Arc<Event>>, ApiError> {
        Self::history_since(&self.lock(), rv)
    }

    fn history_since(inner: &Inner, rv: u64) -> Result<Vec<Arc<Event>>, ApiError> {
        if rv < inner.floor {
            return Err(ApiError::gone(format!(
                "too old resource version: {rv} ({})",
                inner.floor
            )));
        }
        let start = inner.history.partition_point(|e| e.rv <= rv);
        Ok(inner.history.range(start..).cloned().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cm(ns: &str, name: &str) -> Value {
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": ns}, "data": {"k": "v"}})
    }

    fn store_with_default() -> Result<Store, ApiError> {
        let store = Store::new();
        store.create(
            Resource::Namespaces,
            json!({"metadata": {"name": "default"}}),
            false,
        )?;
        Ok(store)
    }

    #[test]
    fn create_get_update_delete() -> Result<(), ApiError> {
        let store = store_with_default()?;
        let created = store.create(Resource::ConfigMaps, cm("default", "a"), false)?;
        let rv = created["metadata"]["resourceVersion"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert_eq!(
            store
                .create(Resource::ConfigMaps, cm("default", "a"), false)
                .map_err(|e| e.code),
            Err(409)
        );
        assert_eq!(
            store
                .create(Resource::ConfigMaps, cm("nope", "a"), false)
                .map_err(|e| e.message),
            Err("namespaces \"nope\" not found".into())
        );
        assert_eq!(store.get(Resource::ConfigMaps, "default", "a")?, created);

        let updated = store.update(Resource::ConfigMaps, "default", "a", false, |cur| {
            let mut next = cur.clone();
            next["data"]["k"] = json!("w");
            Ok(next)
        })?;
        assert_ne!(
            updated["metadata"]["resourceVersion"].as_str(),
            Some(rv.as_str())
        );
        assert_eq!(updated["metadata"]["uid"], created["metadata"]["uid"]);
        let stale = store.update(Resource::ConfigMaps, "default", "a", false, |_| {
            Ok(created.clone())
        });
        assert_eq!(stale.map_err(|e| e.reason), Err("Conflict"));
        let unchanged = store.update(Resource::ConfigMaps, "default", "a", false, |cur| {
            Ok(cur.clone())
        })?;
        assert_eq!(unchanged, updated);

        store.delete(Resource::ConfigMaps, "default", "a", false, |_| Ok(()))?;
        assert_eq!(
            store
                .get(Resource::ConfigMaps, "default", "a")
                .map_err(|e| e.code),
            Err(404)
        );
        Ok(())
    }

    #[test]
    fn pages_cover_everything_once() -> Result<(), ApiError> {
        let store = store_with_default()?;
        for i in 0..25 {
            store.create(
                Resource::ConfigMaps,
                cm("default", &format!("cm-{i:02}")),
                false,
            )?;
        }
        let mut seen = Vec::new();
        let mut after = None;
        loop {
            let page = store.list(
                Resource::ConfigMaps,
                Some("default"),
                &|_| true,
                Some(10),
                after.take(),
            );
            seen.extend(page.items.iter().map(|o| {
                o["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string()
            }));
            match page.next {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        assert_eq!(seen.len(), 25);
        seen.dedup();
        assert_eq!(seen.len(), 25);
        assert_eq!(
            store
                .list(Resource::ConfigMaps, None, &|_| true, None, None)
                .items
                .len(),
            25
        );
        assert_eq!(
            store
                .list(Resource::Pods, None, &|_| true, None, None)
                .items
                .len(),
            0
        );
        Ok(())
    }

    #[test]
    fn watch_replays_from_history_and_reports_gone() -> Result<(), ApiError> {
        let store = store_with_default()?;
        let rv = store.current_rv();
        store.create(Resource::ConfigMaps, cm("default", "a"), false)?;
        store.delete(Resource::ConfigMaps, "default", "a", false, |_| Ok(()))?;
        let start = store.watch(Resource::ConfigMaps, Some("default"), Some(rv))?;
        let kinds: Vec<EventType> = start.initial.iter().map(|e| e.kind).collect();
        assert_eq!(kinds, [EventType::Added, EventType::Deleted]);
        assert_eq!(
            store
                .watch(Resource::ConfigMaps, Some("default"), Some(0))
                .map(|_| ())
                .map_err(|e| e.code),
            Err(410)
        );
        let now = store.watch(Resource::Namespaces, None, None)?;
        assert_eq!(now.initial.len(), 1);
        Ok(())
    }

    #[test]
    fn deleting_a_namespace_deletes_its_objects() -> Result<(), ApiError> {
        let store = store_with_default()?;
        store.create(
            Resource::Namespaces,
            json!({"metadata": {"name": "tmp"}}),
            false,
        )?;
        store.create(Resource::ConfigMaps, cm("tmp", "a"), false)?;
        store.delete(Resource::Namespaces, "", "tmp", false, |_| Ok(()))?;
        assert!(!store.exists(Resource::ConfigMaps, "tmp", "a"));
        Ok(())
    }
}
